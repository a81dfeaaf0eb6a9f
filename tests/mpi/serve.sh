#!/usr/bin/env bash
# `apus serve` over MPI ranks (issue 43): rank 0 answers HTTP, every rank computes each request.
# An image (guided, so cfg or Ulysses splits it) and a clip come back byte for byte as one process
# writes them, the job's record says how they split; a cancelled request stops every rank at the
# same step and the next request still matches; a rank killed mid-request gets that request a 503
# and ends the job, and the job restarted on the same --output-dir lists the earlier jobs and
# serves again; a rank that hangs ends the job once --rank-timeout passes, its request answered
# 503 naming the exchange; a server started with --parallel tensor (each rank holding its share of
# each model's transformer: klein's and Stable Audio 3's) serves one process's bytes too, and so
# does one whose models auto opened split because a rank's memory could not hold them; one with
# --parallel batch deals a request's outputs out over the ranks, one process's -n files.
# Skipped (77) without mpirun or without MPI in the build.
# Usage: tests/mpi/serve.sh APUS FIXTURES
set -euo pipefail
apus="$(realpath "$1")" fixtures="$(realpath "$2")"
source "$(dirname "$(realpath "$0")")/ranks.sh"
source "$(dirname "$(realpath "$0")")/../sa3_model_dir.sh"
mpi_ready "mpi serve" "$apus"
scratch="$(mktemp -d)"
trap 'pkill -KILL -f "^$apus serve .*$scratch" 2> /dev/null || true; rm -rf "$scratch"' EXIT
cd "$scratch"
sa3="$scratch/sa3"
sa3_model_dir "$fixtures" "$sa3"
fail() { echo "mpi serve: $*" >&2; exit 1; }
json() { python3 -c "import json, sys; d = json.load(sys.stdin); print($1)"; }

models=(--model "$fixtures/klein_tiny_base" --model "$sa3")
# Starts `mpirun -np 2 apus serve` over $models logging to $1 (its exit status appended as "exit N"); sets port.
start() {
  local log="$1" i
  shift
  : > "$log"
  ( (set +e; mpirun -np 2 -x OMP_NUM_THREADS=1 "$apus" serve --port 0 "${models[@]}" \
    --output-dir "$scratch/kept" "$@" > "$log" 2>&1; echo "exit $?" >> "$log") &)
  for i in $(seq 1 600); do
    grep -q "^serving [0-9]* model(s) on http://127.0.0.1:[0-9]* over 2 ranks" "$log" && break
    grep -q "^exit " "$log" && { cat "$log"; fail "the server did not start"; }
    sleep 0.1
  done
  port="$(grep -o "127.0.0.1:[0-9]*" "$log" | head -1 | cut -d: -f2)"
  [ -n "$port" ] || { cat "$log"; fail "the server did not say its port"; }
}
# The process of rank $1 of this test's server.
rank_pid() {
  local pid
  for pid in $(pgrep -f "^$apus serve .*$scratch"); do
    tr '\0' '\n' < "/proc/$pid/environ" | grep -qx "OMPI_COMM_WORLD_RANK=$1" && { echo "$pid"; return; }
  done
  fail "no rank $1"
}
# Waits until the log $1 says the job ended (up to 30 s); prints its exit line.
ended() {
  local i
  for i in $(seq 1 300); do grep -q "^exit " "$1" && { grep "^exit " "$1"; return; }; sleep 0.1; done
  cat "$1" >&2
  fail "the job did not end"
}
post() { curl -s -X POST "127.0.0.1:$port$1" -H 'Content-Type: application/json' -d "$2" "${@:3}"; }
# Waits up to 30 s for job $1 to be done or failed.
finish_job() {
  local i state
  for i in $(seq 1 300); do
    state="$(curl -s "127.0.0.1:$port/v1/jobs/$1" | json "d['state']")"
    [ "$state" = done ] || [ "$state" = failed ] && return
    sleep 0.1
  done
}
# Cancels job $1 once it has run a step and prints its state after up to $2 tenths of a second.
cancel_job() {
  local i state
  for i in $(seq 1 600); do
    [ "$(curl -s "127.0.0.1:$port/v1/jobs/$1" | json "d['step']")" -ge 1 ] && break
    sleep 0.1
  done
  curl -s -X DELETE "127.0.0.1:$port/v1/jobs/$1" > /dev/null
  for i in $(seq 1 "$2"); do
    state="$(curl -s "127.0.0.1:$port/v1/jobs/$1" | json "d['state']")"
    [ "$state" = cancelled ] && break
    sleep 0.1
  done
  echo "$state"
}
b64_file() { json "d['data'][0]['b64_json']" | base64 -d > "$1"; }

guided='{"prompt": "a fox", "size": "32x32", "steps": 2, "seed": 5, "cfg": 4}'
"$apus" image --model "$fixtures/klein_tiny_base" -p "a fox" -W 32 -H 32 --steps 2 -s 5 --cfg 4 -o one.png 2> /dev/null
"$apus" audio --model "$sa3" -p "rain" --seconds 1 --steps 2 -s 3 --cfg 4 --negative-prompt wind -o one.wav 2> /dev/null

start serve.log
post /v1/images/generations "$guided" | b64_file ranks.png
cmp -s one.png ranks.png || fail "the image served over 2 ranks differs from one process's"
post /v1/audio/generations '{"prompt": "rain", "seconds": 1, "steps": 2, "seed": 3, "cfg": 4, "negative_prompt": "wind",
  "format": "wav"}' > ranks.wav
cmp -s one.wav ranks.wav || fail "the clip served over 2 ranks differs from one process's"
id="$(post /v1/jobs '{"kind": "image", "prompt": "a fox", "size": "32x32", "steps": 2, "seed": 5, "cfg": 4}' | json "d['id']")"
finish_job "$id"
split="$(curl -s "127.0.0.1:$port/v1/jobs/$id" | json "d.get('split')")"
kept_id="$id"
[[ "$split" =~ ^(cfg|ulysses)\ over\ 2\ ranks$ ]] || fail "the job's record says it split as '$split'"

# Cancelled mid-request: every rank stops at the same step, and the next request still matches.
long='{"kind": "image", "prompt": "a fox", "size": "256x256", "steps": 200, "seed": 5, "cfg": 4}'
state="$(cancel_job "$(post /v1/jobs "$long" | json "d['id']")" 300)"
[ "$state" = cancelled ] || fail "the long job is $state, not cancelled"
post /v1/images/generations "$guided" | b64_file again.png
cmp -s one.png again.png || fail "after a cancel, the image differs from one process's"

# Rank 1 killed mid-request: the request gets 503 and the job ends.
# Long enough (512x512, 200 steps: ~10 s over 2 ranks) to be in flight 2 s after it is posted.
unkinded='{"prompt": "a fox", "size": "512x512", "steps": 200, "seed": 5, "cfg": 4}'
(post /v1/images/generations "$unkinded" -w '\n%{http_code}\n' > killed.txt &)
sleep 2
kill -KILL "$(rank_pid 1)"
ended serve.log | grep -qv "^exit 0$" || fail "the job ended well with rank 1 killed"
for i in $(seq 1 100); do [ -s killed.txt ] && break; sleep 0.1; done
tail -1 killed.txt | grep -qx 503 || { cat killed.txt serve.log; fail "the request in flight was not answered 503"; }
grep -q "the job is ending" killed.txt || { cat killed.txt; fail "the 503 does not say the job is ending"; }

# Restarted on the same --output-dir: the earlier jobs are listed, and it serves.
start restarted.log --rank-timeout 2
curl -s "127.0.0.1:$port/v1/jobs" | json "[j['id'] for j in d['data']]" | grep -q "$kept_id" ||
  fail "the restarted server does not list the jobs kept before"
post /v1/images/generations "$guided" | b64_file restarted.png
cmp -s one.png restarted.png || fail "after a restart, the image differs from one process's"

# Rank 1 hangs (stopped): past --rank-timeout the request gets 503 naming the exchange, and the job ends.
(post /v1/images/generations "$unkinded" -w '\n%{http_code}\n' > hung.txt &)
sleep 2
kill -STOP "$(rank_pid 1)"
ended restarted.log | grep -qv "^exit 0$" || fail "the job ended well with rank 1 hung"
tail -1 hung.txt | grep -qx 503 || { cat hung.txt restarted.log; fail "the hung request was not answered 503"; }
grep -q "not every rank arrived within 2 s" hung.txt || { cat hung.txt; fail "the 503 does not name the wait"; }
grep -q "^error: rank 0 of 2: a rank was lost" restarted.log || { cat restarted.log; fail "rank 0's last line"; }
# --parallel tensor: the transformers' weights split over the ranks as the server starts; a guided
# image and a guided clip (both branches on every rank) are one process's, and a record says how it ran.
models=(--model "$fixtures/klein_tiny_base" --model "$sa3")
start tensor.log --parallel tensor
id="$(post /v1/jobs '{"kind": "image", "prompt": "a fox", "size": "32x32", "steps": 2, "seed": 5, "cfg": 4}' | json "d['id']")"
finish_job "$id"
[ "$(curl -s "127.0.0.1:$port/v1/jobs/$id" | json "d.get('split')")" = "tensor over 2 ranks" ] ||
  fail "the tensor job's record: $(curl -s "127.0.0.1:$port/v1/jobs/$id")"
post /v1/images/generations "$guided" | b64_file tensor.png
cmp -s one.png tensor.png || fail "the image served with the weights split over 2 ranks differs from one process's"
post /v1/audio/generations '{"prompt": "rain", "seconds": 1, "steps": 2, "seed": 3, "cfg": 4, "negative_prompt": "wind",
  "format": "wav"}' > tensor.wav
cmp -s one.wav tensor.wav || fail "the clip served with the weights split over 2 ranks differs from one process's"
# A clip with live previews: each decoded by SAME, whose features are split too, on both ranks.
id="$(post /v1/jobs '{"kind": "audio", "prompt": "rain", "seconds": 1, "steps": 2, "seed": 3, "preview": true}' |
  json "d['id']")"
finish_job "$id"
[ "$(curl -s "127.0.0.1:$port/v1/jobs/$id" | json "d['state'] + ' ' + str(len(d.get('preview', {}).get('peaks', [])) > 0)")" = "done True" ] ||
  fail "the previewed clip over 2 tensor ranks: $(curl -s "127.0.0.1:$port/v1/jobs/$id")"
# --parallel batch: a request's outputs dealt out over the ranks (3 images: 2 on rank 0, 1 on
# rank 1), rank 0 gathering them: each is one process's -n output, and a job's record says so.
# One output gives way to auto. A cancel stops every rank's share at the next step (the flags
# agreed before each); the next request still matches.
pkill -TERM -f "^mpirun .* serve .*--parallel tensor" || true
ended tensor.log > /dev/null
"$apus" image --model "$fixtures/klein_tiny_base" -p "a fox" -W 32 -H 32 --steps 2 -s 5 --cfg 4 -n 3 -o one-n.png 2> /dev/null
start batch.log --parallel batch
post /v1/images/generations '{"prompt": "a fox", "size": "32x32", "steps": 2, "seed": 5, "cfg": 4, "n": 3}' > batch.json
for i in 1 2 3; do
  json "d['data'][$i - 1]['b64_json']" < batch.json | base64 -d > "batch-$i.png"
  cmp -s "one-n-$i.png" "batch-$i.png" || fail "image $i of 3 split by outputs over 2 ranks differs from one process's"
done
id="$(post /v1/jobs '{"kind": "image", "prompt": "a fox", "size": "32x32", "steps": 2, "seed": 5, "cfg": 4, "n": 2}' |
  json "d['id']")"
finish_job "$id"
[ "$(curl -s "127.0.0.1:$port/v1/jobs/$id" | json "d.get('split')")" = "batch over 2 ranks" ] ||
  fail "the batch job's record: $(curl -s "127.0.0.1:$port/v1/jobs/$id")"
for i in 1 2; do
  curl -s "127.0.0.1:$port/v1/jobs/$id/files/$((i - 1))" > "job-$i.png"
  cmp -s "one-n-$i.png" "job-$i.png" || fail "the job's image $i of 2 split by outputs differs from one process's"
done
post /v1/images/generations "$guided" | b64_file batch-one.png
cmp -s one.png batch-one.png || fail "one image on a batch server differs from one process's"
# Two 1024x1024 images of 200 steps (a minute or more for rank 1's alone): cancelled after the
# first step, both ranks stop at the next, so the job is cancelled long before rank 1 could finish.
huge='{"kind": "image", "prompt": "a fox", "size": "1024x1024", "steps": 200, "seed": 5, "cfg": 4, "n": 2}'
state="$(cancel_job "$(post /v1/jobs "$huge" | json "d['id']")" 150)"
[ "$state" = cancelled ] || fail "the batch job is $state 15 s after its cancel: rank 1's share did not stop"
post /v1/images/generations "$guided" | b64_file batch-again.png
cmp -s one.png batch-again.png || fail "after a cancelled batch, the image differs from one process's"
pkill -TERM -f "^mpirun .* serve .*--parallel batch" || true
ended batch.log > /dev/null
# auto with less memory a rank than one process needs (--rank-memory): both models open split,
# each named, and their requests run as tensor, one process's bytes.
start memory.log --rank-memory 0.001
[ "$(grep -c "^serve: .* opens with its weights split over the 2 ranks (tensor): one process needs about .* more than the 1.1 MB a rank has: --rank-memory$" memory.log)" = 2 ] ||
  { cat memory.log; fail "auto did not open both models split for a rank's memory"; }
post /v1/images/generations "$guided" | b64_file memory.png
cmp -s one.png memory.png || fail "the image served by a model auto split differs from one process's"
post /v1/audio/generations '{"prompt": "rain", "seconds": 1, "steps": 2, "seed": 3, "cfg": 4, "negative_prompt": "wind",
  "format": "wav"}' > memory.wav
cmp -s one.wav memory.wav || fail "the clip served by a model auto split differs from one process's"
echo "mpi serve: requests over 2 ranks are one process's (split by requests, by outputs and by weights); cancel, a killed and a hung rank handled"
