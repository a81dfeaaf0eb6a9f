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
button{grid-column:4;padding:.5em;font-size:1em}.hidden{display:none!important}
#bar{height:.6em;background:#ddd;border-radius:3px;margin:.8em 0}#fill{height:100%;width:0;background:#3a7bd5;border-radius:3px}
#status{font-size:.9em;min-height:1.2em}#gallery{display:grid;grid-template-columns:repeat(auto-fill,minmax(14em,1fr));gap:.8em}
.card{background:#fff;padding:.5em;border-radius:6px;font-size:.8em}.card img{width:100%}.card audio{width:100%}
#inputs{grid-column:1/5;display:flex;gap:1em;flex-wrap:wrap;align-items:flex-start}
#paint{position:relative;display:inline-block}#paint canvas{max-width:24em;display:block}
#maskcanvas{position:absolute;left:0;top:0;opacity:.45;cursor:crosshair;touch-action:none}
#refs img{height:4em;margin-right:.3em}
#shown{width:16em;image-rendering:pixelated}#wave{width:32em;height:4em;background:#fff}
#cancel{grid-column:3}
/* A phone's width: two columns, the buttons across, Generate in reach. */
@media (max-width:40em){#form{grid-template-columns:minmax(0,1fr) minmax(0,1fr)}#form textarea,#inputs{grid-column:1/3}
button,#cancel{grid-column:1/3}#form label{min-width:0}
#form input:not([type=checkbox]),#form select,#form textarea{width:100%;box-sizing:border-box;min-width:0}
#wave{width:100%}#paint canvas{max-width:100%}header input{width:10em}}
</style></head><body>
<header><h1>apus</h1><form id="keyform" onsubmit="return false"><input id="key" type="password"
autocomplete="off" placeholder="API key (if the server asks)"></form></header>
<main>
<form id="form">
<label>model<select id="model"></select></label>
<label class="image">width<input id="width" type="number" value="1024" step="16" min="16"></label>
<label class="image">height<input id="height" type="number" value="1024" step="16" min="16"></label>
<label class="audio hidden">seconds<input id="seconds" type="number" value="30" step="any" min="0.1"></label>
<label>seed (empty: random)<input id="seed" type="number" min="0"></label>
<label>steps (empty: the model's)<input id="steps" type="number" min="1"></label>
<label>live preview<input id="preview" type="checkbox" checked></label>
<label class="lora">LoRA<select id="lora"><option value="">(none)</option></select></label>
<label class="lora">LoRA scale<input id="lora_scale" type="number" value="1" step="0.05"></label>
<textarea id="prompt" placeholder="prompt"></textarea>
<label>negative prompt (guided models)<input id="negative_prompt"></label>
<label>guidance (empty: the model's)<input id="cfg" type="number" step="any" min="0"></label>
<label class="image">reference images (editing)<input id="refs_in" type="file" accept="image/*" multiple></label>
<label class="image">inpaint strength<input id="strength" type="number" value="0.8" step="0.05" min="0" max="1"></label>
<label class="audio hidden">init audio (audio-to-audio)<input id="init_in" type="file" accept="audio/*"></label>
<label class="audio hidden">init noise level<input id="init_noise_level" type="number" step="any" min="0"></label>
<label class="audio hidden">inpaint audio<input id="inpaint_in" type="file" accept="audio/*"></label>
<label class="audio hidden">regions to generate (s: 1-2.5, 4-5)<input id="inpaint_regions"></label>
<div id="inputs" class="image"><div id="refs"></div>
<div id="paint" class="hidden"><canvas id="imagecanvas"></canvas><canvas id="maskcanvas"></canvas>
<div>brush <input id="brush" type="range" min="2" max="64" value="16"> <button id="clearmask" type="button">clear mask</button>
(paint over the first image where it is to be repainted)</div></div></div>
<button id="cancel" type="button" class="hidden">Cancel</button>
<button id="go" type="submit">Generate</button>
</form>
<div id="bar"><div id="fill"></div></div><div id="status"></div>
<div id="live"><img id="shown" class="hidden" alt="preview"><canvas id="wave" class="hidden" width="512" height="64"></canvas></div>
<div id="gallery"></div>
</main>
<script>
const $ = id => document.getElementById(id);
$('key').value = localStorage.getItem('apus-key') || '';
// A key typed in is used at once: the models and LoRAs it may see are listed again.
$('key').onchange = () => { localStorage.setItem('apus-key', $('key').value); loadModels(); };
const headers = () => $('key').value ? {'Authorization': 'Bearer ' + $('key').value, 'Content-Type': 'application/json'}
                                     : {'Content-Type': 'application/json'};
let kinds = {};
// The form's files as base64 (no data: prefix), as the JSON routes take them.
const files = {refs: [], init: null, inpaint: null};
let masked = false;  // whether the brush has painted anything
const base64 = url => url.slice(url.indexOf(',') + 1);
const readUrl = file => new Promise((ok, fail) => {
  const r = new FileReader();
  r.onload = () => ok(r.result);
  r.onerror = () => fail(r.error);
  r.readAsDataURL(file);
});
// The reference images; the first is the one the mask repaints, drawn under the brush's canvas.
async function setReferences(urls) {
  files.refs = urls.map(base64);
  $('refs').innerHTML = '';
  for (const u of urls) $('refs').append(Object.assign(document.createElement('img'), {src: u}));
  $('paint').classList.toggle('hidden', urls.length === 0);
  if (!urls.length) return;
  const img = new Image();
  await new Promise((ok, fail) => { img.onload = ok; img.onerror = fail; img.src = urls[0]; });
  for (const c of [$('imagecanvas'), $('maskcanvas')]) { c.width = img.naturalWidth; c.height = img.naturalHeight; }
  $('imagecanvas').getContext('2d').drawImage(img, 0, 0);
  clearMask();
}
function clearMask() {
  const g = $('maskcanvas').getContext('2d');
  g.fillStyle = '#000';
  g.fillRect(0, 0, $('maskcanvas').width, $('maskcanvas').height);
  masked = false;
}
// The brush paints white (repaint) on black (keep), in the image's own pixels.
function paintAt(x, y) {
  const c = $('maskcanvas'), box = c.getBoundingClientRect(), g = c.getContext('2d');
  const sx = c.width / box.width, r = Number($('brush').value) * sx / 2;
  g.fillStyle = '#fff';
  g.beginPath();
  g.arc((x - box.left) * sx, (y - box.top) * c.height / box.height, r, 0, 2 * Math.PI);
  g.fill();
  masked = true;
}
let painting = false;
$('maskcanvas').onpointerdown = e => { painting = true; paintAt(e.clientX, e.clientY); };
$('maskcanvas').onpointermove = e => { if (painting) paintAt(e.clientX, e.clientY); };
window.onpointerup = () => { painting = false; };
$('clearmask').onclick = clearMask;
$('refs_in').onchange = async () => setReferences(await Promise.all([...$('refs_in').files].map(readUrl)));
$('init_in').onchange = async () => { files.init = $('init_in').files[0] ? base64(await readUrl($('init_in').files[0])) : null; };
$('inpaint_in').onchange = async () => { files.inpaint = $('inpaint_in').files[0] ? base64(await readUrl($('inpaint_in').files[0])) : null; };
// "1-2.5, 4-5" -> [[1, 2.5], [4, 5]]
const regions = text => text.split(',').filter(r => r.trim()).map(r => r.split('-').map(Number));
async function loadModels() {
  const r = await fetch('/v1/models', {headers: headers()});
  if (!r.ok) { $('status').textContent = 'models: ' + (await r.json()).error.message; return; }
  $('model').innerHTML = '';
  $('status').textContent = '';
  for (const m of (await r.json()).data) {
    kinds[m.id] = m.kind;
    $('model').add(new Option(m.id + ' (' + m.kind + ')', m.id));
  }
  // The LoRAs the server offers (--lora-dir); the picker shows only where there are any.
  const l = await fetch('/v1/loras', {headers: headers()});
  while ($('lora').options.length > 1) $('lora').remove(1);
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
  if ($('negative_prompt').value) body.negative_prompt = $('negative_prompt').value;
  if ($('cfg').value !== '') body.cfg = Number($('cfg').value);
  if (kind === 'image') {
    body.size = $('width').value + 'x' + $('height').value;
    if (files.refs.length) body.images = files.refs;
    if (files.refs.length && masked) {
      delete body.size;  // an inpainting keeps its image's size
      body.mask = base64($('maskcanvas').toDataURL('image/png'));
      body.strength = Number($('strength').value);
    }
  } else {
    body.seconds = Number($('seconds').value);
    if (files.init) body.init_audio = files.init;
    if ($('init_noise_level').value !== '') body.init_noise_level = Number($('init_noise_level').value);
    if (files.inpaint) body.inpaint_audio = files.inpaint;
    if ($('inpaint_regions').value.trim()) body.inpaint_regions = regions($('inpaint_regions').value);
  }
  if ($('lora').value) body.loras = [{name: $('lora').value, scale: Number($('lora_scale').value)}];
  if ($('preview').checked) body.preview = true;
  $('go').disabled = true;
  try {
    const r = await fetch('/v1/jobs', {method: 'POST', headers: headers(), body: JSON.stringify(body)});
    const job = await r.json();
    if (!r.ok) throw new Error(job.error.message);
    // Cancel asks the server to stop the job (DELETE /v1/jobs/ID): it ends within a step.
    $('cancel').onclick = () => fetch('/v1/jobs/' + job.id, {method: 'DELETE', headers: headers()});
    $('cancel').classList.remove('hidden');
    await follow(job.id, body);
  } catch (e) { $('status').textContent = 'error: ' + e.message; }
  $('cancel').classList.add('hidden');
  $('go').disabled = false;
};
// Polls the job (its JSON carries the latest preview); an event stream would not carry the API key.
async function follow(id, request) {
  for (;;) {
    const j = await (await fetch('/v1/jobs/' + id, {headers: headers()})).json();
    $('fill').style.width = (100 * j.progress) + '%';
    $('status').textContent = j.state + (j.steps ? ' step ' + j.step + '/' + j.steps : '');
    if (j.preview) preview(j.preview);
    if (j.state === 'done') {
      // The results replace the step's look at them.
      for (const e of [$('shown'), $('wave')]) e.classList.add('hidden');
      for (const res of j.results) show(res, request);
      return;
    }
    if (j.state === 'failed' || j.state === 'cancelled') throw new Error(j.error || j.state);
    await new Promise(ok => setTimeout(ok, 300));
  }
}
// A step's look at the result: the projected image, or the waveform's peaks.
function preview(p) {
  if (p.image) {
    $('shown').src = 'data:image/png;base64,' + p.image;
    $('shown').dataset.step = p.step;
    $('shown').classList.remove('hidden');
  }
  if (p.peaks) {
    const c = $('wave'), g = c.getContext('2d'), n = p.peaks.length / 2;
    g.clearRect(0, 0, c.width, c.height);
    g.fillStyle = '#3a7bd5';
    for (let i = 0; i < n; ++i) {
      const lo = p.peaks[2 * i], hi = p.peaks[2 * i + 1], x = i * c.width / n;
      g.fillRect(x, (1 - hi) * c.height / 2, Math.max(1, c.width / n), Math.max(1, (hi - lo) * c.height / 2));
    }
    c.dataset.step = p.step;
    c.classList.remove('hidden');
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
    download: 'apus-' + res.seed + ({'image/png': '.png', 'image/jpeg': '.jpg', 'image/webp': '.webp',
                                     'audio/flac': '.flac'}[res.mime] || '.wav')});
  const text = document.createElement('div');
  const loras = (request.loras || []).map(a => ' LoRA ' + a.name + ':' + a.scale).join('');
  text.textContent = request.prompt + ' (seed ' + res.seed + loras + ') ';
  text.append(link);
  card.append(media, text);
  $('gallery').prepend(card);
  while ($('gallery').children.length > 12) $('gallery').lastChild.remove();
}
// A link can fill the form and run it:
// ?model=ID&prompt=...&size=WxH|seconds=S&seed=N&steps=N&lora=NAME&lora_scale=S&negative_prompt=...&cfg=G&preview=0|1
//  &ref=IMAGE_URL (repeatable)&mask_rect=X,Y,W,H (painted on the first, in its pixels)&strength=S
//  &init_audio=URL&init_noise_level=L&inpaint_audio=URL&inpaint_regions=A-B,C-D&run=1, after ? or #
async function start() {
  await loadModels();
  // After # the link stays in the browser: room for data: URLs of whole files.
  const q = new URLSearchParams(location.search + '&' + location.hash.slice(1));
  if (q.has('model')) { $('model').value = q.get('model'); showFields(); }
  if (q.has('prompt')) $('prompt').value = q.get('prompt');
  if (q.has('size')) { const [w, h] = q.get('size').split('x'); $('width').value = w; $('height').value = h; }
  for (const k of ['seconds', 'seed', 'steps', 'lora', 'lora_scale', 'negative_prompt', 'cfg', 'strength',
                   'init_noise_level', 'inpaint_regions'])
    if (q.has(k)) $(k).value = q.get(k);
  if (q.has('preview')) $('preview').checked = q.get('preview') === '1';
  const fetched = async url => readUrl(await (await fetch(url)).blob());
  if (q.has('ref')) await setReferences(await Promise.all(q.getAll('ref').map(fetched)));
  if (q.has('mask_rect')) {
    const [x, y, w, h] = q.get('mask_rect').split(',').map(Number), g = $('maskcanvas').getContext('2d');
    g.fillStyle = '#fff';
    g.fillRect(x, y, w, h);
    masked = true;
  }
  if (q.has('init_audio')) files.init = base64(await fetched(q.get('init_audio')));
  if (q.has('inpaint_audio')) files.inpaint = base64(await fetched(q.get('inpaint_audio')));
  if (q.get('run') === '1') $('form').requestSubmit();
}
start();
</script></body></html>
)html";
}

}  // namespace apus::server
