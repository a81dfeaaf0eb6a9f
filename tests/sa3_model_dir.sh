# Sourced by the shell tests: sa3_model_dir FIXTURES DIR links the tiny Stable Audio 3 model into
# DIR in its official layout (model_config.json, model.safetensors, the T5Gemma folder), as
# tests/sa3_fixtures.h assembles it.
sa3_model_dir() {
  local fixtures="$1" dir="$2" f
  mkdir -p "$dir/t5gemma-b-b-ul2"
  ln -s "$fixtures/sa3_tiny/original/model_config.json" "$fixtures/sa3_tiny/original/model.safetensors" "$dir/"
  for f in config.json model.safetensors; do ln -s "$fixtures/t5gemma_tiny/$f" "$dir/t5gemma-b-b-ul2/$f"; done
  for f in tokenizer.model tokenizer_config.json; do ln -s "$fixtures/t5gemma_tok/$f" "$dir/t5gemma-b-b-ul2/$f"; done
}
