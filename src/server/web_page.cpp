#include "server/web_page.h"

namespace apus::server {

const char* web_page() {
  return R"html(<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>apus</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body{font-family:system-ui,sans-serif;margin:0;background:#f6f6f4;color:#222}
header{background:#1d2b3a;color:#fff;padding:.6em 1em;display:flex;gap:1em;align-items:center}
header h1{font-size:1.2em;margin:0}#keyform{margin-left:auto}
main{max-width:64em;margin:1em auto;padding:0 1em}
#form{display:grid;grid-template-columns:repeat(4,1fr);gap:.6em;background:#fff;padding:1em;border-radius:6px}
#form textarea{grid-column:1/5;min-height:4em}label{display:flex;flex-direction:column;font-size:.85em}
button{grid-column:4;padding:.5em;font-size:1em}.hidden{display:none}
#bar{height:.6em;background:#ddd;border-radius:3px;margin:.8em 0}#fill{height:100%;width:0;background:#3a7bd5;border-radius:3px}
#status{font-size:.9em;min-height:1.2em}#gallery{display:grid;grid-template-columns:repeat(auto-fill,minmax(14em,1fr));gap:.8em}
.card{background:#fff;padding:.5em;border-radius:6px;font-size:.8em}.card img{width:100%}.card audio{width:100%}
</style></head><body>
<header><h1>apus</h1><form id="keyform" onsubmit="return false"><input id="key" type="password"
autocomplete="off" placeholder="API key (if the server asks)"></form></header>
<main>
<form id="form">
<label>model<select id="model"></select></label>
<label class="image">width<input id="width" type="number" value="1024" step="16" min="16"></label>
<label class="image">height<input id="height" type="number" value="1024" step="16" min="16"></label>
<label class="audio hidden">seconds<input id="seconds" type="number" value="10" step="any" min="0.1"></label>
<label>seed (empty: random)<input id="seed" type="number" min="0"></label>
<label>steps (empty: the model's)<input id="steps" type="number" min="1"></label>
<label class="lora">LoRA<select id="lora"><option value="">(none)</option></select></label>
<label class="lora">LoRA scale<input id="lora_scale" type="number" value="1" step="0.05"></label>
<textarea id="prompt" placeholder="prompt"></textarea>
<button id="go" type="submit">Generate</button>
</form>
<div id="bar"><div id="fill"></div></div><div id="status"></div>
<div id="gallery"></div>
</main>
<script>
const $ = id => document.getElementById(id);
$('key').value = localStorage.getItem('apus-key') || '';
$('key').onchange = () => localStorage.setItem('apus-key', $('key').value);
const headers = () => $('key').value ? {'Authorization': 'Bearer ' + $('key').value, 'Content-Type': 'application/json'}
                                     : {'Content-Type': 'application/json'};
let kinds = {};
async function loadModels() {
  const r = await fetch('/v1/models', {headers: headers()});
  if (!r.ok) { $('status').textContent = 'models: ' + (await r.json()).error.message; return; }
  $('model').innerHTML = '';
  for (const m of (await r.json()).data) {
    kinds[m.id] = m.kind;
    $('model').add(new Option(m.id + ' (' + m.kind + ')', m.id));
  }
  // The LoRAs the server offers (--lora-dir); the picker shows only where there are any.
  const l = await fetch('/v1/loras', {headers: headers()});
  if (l.ok) for (const a of (await l.json()).data) $('lora').add(new Option(a.id, a.id));
  showFields();
}
function showFields() {
  const kind = kinds[$('model').value];
  for (const e of document.querySelectorAll('.image')) e.classList.toggle('hidden', kind !== 'image');
  for (const e of document.querySelectorAll('.audio')) e.classList.toggle('hidden', kind !== 'audio');
  if ($('lora').options.length < 2) for (const e of document.querySelectorAll('.lora')) e.classList.add('hidden');
}
$('model').onchange = showFields;
$('form').onsubmit = async ev => {
  ev.preventDefault();
  const model = $('model').value, kind = kinds[model];
  const body = {kind, model, prompt: $('prompt').value};
  if ($('seed').value !== '') body.seed = Number($('seed').value);
  if ($('steps').value !== '') body.steps = Number($('steps').value);
  if (kind === 'image') body.size = $('width').value + 'x' + $('height').value;
  else body.seconds = Number($('seconds').value);
  if ($('lora').value) body.loras = [{name: $('lora').value, scale: Number($('lora_scale').value)}];
  $('go').disabled = true;
  try {
    const r = await fetch('/v1/jobs', {method: 'POST', headers: headers(), body: JSON.stringify(body)});
    const job = await r.json();
    if (!r.ok) throw new Error(job.error.message);
    await follow(job.id, body);
  } catch (e) { $('status').textContent = 'error: ' + e.message; }
  $('go').disabled = false;
};
async function follow(id, request) {
  for (;;) {
    const j = await (await fetch('/v1/jobs/' + id, {headers: headers()})).json();
    $('fill').style.width = (100 * j.progress) + '%';
    $('status').textContent = j.state + (j.steps ? ' step ' + j.step + '/' + j.steps : '');
    if (j.state === 'done') { for (const res of j.results) show(res, request); return; }
    if (j.state === 'failed' || j.state === 'cancelled') throw new Error(j.error || j.state);
    await new Promise(ok => setTimeout(ok, 300));
  }
}
function show(res, request) {
  const url = 'data:' + res.mime + ';base64,' + res.b64;
  const card = document.createElement('div');
  card.className = 'card';
  const media = res.mime.startsWith('image') ? Object.assign(document.createElement('img'), {src: url})
                                             : Object.assign(document.createElement('audio'), {src: url, controls: true});
  // Marks the result ready: an image once drawn; a clip when the browser can play its type (its
  // header is read later, on the media pipeline's own clock).
  if (res.mime.startsWith('image')) media.addEventListener('load', () => card.dataset.ready = 'yes');
  else if (media.canPlayType(res.mime)) card.dataset.ready = 'yes';
  const link = Object.assign(document.createElement('a'), {href: url, textContent: 'download',
    download: 'apus-' + res.seed + (res.mime === 'image/png' ? '.png' : res.mime === 'audio/flac' ? '.flac' : '.wav')});
  const text = document.createElement('div');
  const loras = (request.loras || []).map(a => ' LoRA ' + a.name + ':' + a.scale).join('');
  text.textContent = request.prompt + ' (seed ' + res.seed + loras + ') ';
  text.append(link);
  card.append(media, text);
  $('gallery').prepend(card);
  while ($('gallery').children.length > 12) $('gallery').lastChild.remove();
}
// A link can fill the form and run it:
// ?model=ID&prompt=...&size=WxH|seconds=S&seed=N&steps=N&lora=NAME&lora_scale=S&run=1
async function start() {
  await loadModels();
  const q = new URLSearchParams(location.search);
  if (q.has('model')) { $('model').value = q.get('model'); showFields(); }
  if (q.has('prompt')) $('prompt').value = q.get('prompt');
  if (q.has('size')) { const [w, h] = q.get('size').split('x'); $('width').value = w; $('height').value = h; }
  for (const k of ['seconds', 'seed', 'steps', 'lora', 'lora_scale']) if (q.has(k)) $(k).value = q.get(k);
  if (q.get('run') === '1') $('form').requestSubmit();
}
start();
</script></body></html>
)html";
}

}  // namespace apus::server
