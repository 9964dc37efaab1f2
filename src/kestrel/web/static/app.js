// kestrel serve: segment in the page with SAM 2.1's edge split (seed 002).
//
// Once per image the encoder runs (here with onnxruntime-web, WebGPU when the browser has it and
// WASM otherwise, or on the server with `--encode server`); every click, shift-click and dragged
// box then composes prompt tokens from the prompt tables (composer.js) and runs only the small
// decoder in the page. Every file is checked against the export manifest's sha256 before use.

import * as ort from '/vendor/ort.all.min.mjs';
import { composeTokens, fitPrompt, toModelFrame, FOREGROUND, BACKGROUND } from '/static/composer.js';
import { normalize, resizeBilinear } from '/static/pixels.js';
import { inspectImage } from '/static/imageinfo.js';
import { checkCall } from '/static/signature.js';

const TABLES = {
  gaussian: 'prompt_gaussian.bin', point_fg: 'prompt_point_embed_fg.bin', point_bg: 'prompt_point_embed_bg.bin',
  box_tl: 'prompt_box_tl.bin', box_br: 'prompt_box_br.bin', not_a_point: 'prompt_not_a_point.bin',
  image_pe: 'prompt_img_pos.bin', dense: 'prompt_dense.bin',
};
const IMAGENET = { mean: [0.485, 0.456, 0.406], std: [0.229, 0.224, 0.225], rescale: 1 / 255 };
const DRAG_PIXELS = 5;

const $ = (id) => document.getElementById(id);
const state = {
  config: null, manifest: null, size: 512, tokens: 3, backend: null, tables: null,
  encoder: null, decoder: null, image: null, width: 0, height: 0, features: null,
  history: [], prompt: { points: [], box: null }, decode: null, encodeMs: null, decodeMs: [],
  // each image load has an identity: features and masks carry the load they belong to, and a click is
  // decoded only against its own image's features (waiting for them while that image encodes)
  load: 0, shown: 0, encoding: null, clickMs: [], waitedForEncoder: 0, showMask: true,
};
window.kestrel = state;  // read by the browser tests

function status(text, kind = '') {
  const el = $('status');
  el.textContent = text;
  el.className = kind;
}

async function sha256Hex(buffer) {
  const digest = await crypto.subtle.digest('SHA-256', buffer);
  return [...new Uint8Array(digest)].map((b) => b.toString(16).padStart(2, '0')).join('');
}

// Fetch a file the manifest lists and check its sha256 and size against the manifest.
async function verified(name) {
  const entry = state.manifest.files[name];
  if (!entry) throw new Error(`the export manifest does not list ${name}`);
  const response = await fetch(`/export/${encodeURIComponent(name)}`);
  if (!response.ok) throw new Error(`${name}: HTTP ${response.status}`);
  const buffer = await response.arrayBuffer();
  const digest = await sha256Hex(buffer);
  if (digest !== entry.sha256 || (entry.bytes !== undefined && buffer.byteLength !== entry.bytes)) {
    throw new Error(`${name}: sha256 ${digest} (${buffer.byteLength} bytes) does not match the manifest's ` +
                    `${entry.sha256} (${entry.bytes} bytes); the export was changed after it was written`);
  }
  return buffer;
}

// The ONNX program of a role ("encoder" or "decoder") in the manifest's programs.
function program(role) {
  const programs = state.manifest.export.programs;
  const name = Object.keys(programs).find((k) => k.endsWith('.onnx') && k.includes(role));
  if (!name) throw new Error(`the export has no ONNX ${role} program; export it with --target onnx`);
  return { name, spec: programs[name] };
}

// The call checked against the signature the program carries (signature.js), before onnxruntime-web.
function checked({ name, spec }, feeds) {
  if (spec.signature) checkCall(spec.signature, feeds, name);
}

async function chooseBackend() {
  const wanted = new URLSearchParams(location.search).get('backend');
  if (wanted === 'wasm') return 'wasm';
  const gpu = navigator.gpu && (await navigator.gpu.requestAdapter().catch(() => null));
  if (wanted === 'webgpu' && !gpu) throw new Error('backend=webgpu was asked for, but this browser has no WebGPU adapter');
  return gpu ? 'webgpu' : 'wasm';
}

async function session(name) {
  const bytes = await verified(name);
  return ort.InferenceSession.create(bytes, { executionProviders: [state.backend] });
}

async function start() {
  ort.env.wasm.wasmPaths = '/vendor/';
  ort.env.wasm.numThreads = self.crossOriginIsolated ? Math.min(4, navigator.hardwareConcurrency || 1) : 1;
  state.config = await (await fetch('/api/config')).json();
  state.manifest = await (await fetch(state.config.manifest)).json();
  const decoder = program('decoder');
  state.tokens = decoder.spec.prompt_tokens ?? state.manifest.export.prompt_tokens;
  state.size = program('encoder').spec.inputs[0].shape[2];
  state.backend = await chooseBackend();
  $('model').textContent = `${state.manifest.model} · decoder on ${state.backend}` +
    (state.config.encode === 'server' ? ' · encoder on the server' : ` · encoder on ${state.backend}`);
  status('checking the export and loading the decoder…');
  const tables = {};
  for (const [key, file] of Object.entries(TABLES)) tables[key] = new Float32Array(await verified(file));
  state.tables = tables;
  state.decoder = await session(decoder.name);
  if (state.config.encode === 'page') {
    status('loading the encoder…');
    state.encoder = await session(program('encoder').name);
  }
  status('open or drop an image');
  $('open').disabled = false;
}

// ---- images -----------------------------------------------------------------------------------

async function openImage(file) {
  const load = ++state.load;  // from here on, anything of an earlier image is stale
  state.features = null;
  state.encoding = null;
  state.decode = null;
  state.encodeMs = null;
  const name = file.name || 'the image';
  status(`opening ${name}…`, 'busy');
  let bitmap;
  try {
    const info = await inspectImage(file, { maxBytes: state.config.max_upload_bytes,
                                            maxPixels: state.config.max_upload_pixels });
    bitmap = await createImageBitmap(file, { colorSpaceConversion: 'none', premultiplyAlpha: 'none' }).catch((e) => {
      throw new Error(`${name}: the browser could not decode this ${info.formatName} image (${e.message || e.name})`);
    });
  } catch (e) {
    if (load === state.load) clearImage();  // nothing of the refused file, nor of the image before it, stays
    throw e;
  }
  if (load !== state.load) return;  // another image was opened meanwhile
  const canvas = $('image');
  canvas.width = bitmap.width;
  canvas.height = bitmap.height;
  $('overlay').width = bitmap.width;
  $('overlay').height = bitmap.height;
  const ctx = canvas.getContext('2d', { willReadFrequently: true });
  ctx.drawImage(bitmap, 0, 0);
  state.width = bitmap.width;
  state.height = bitmap.height;
  bitmap.close?.();
  state.image = file;
  state.prompt = { points: [], box: null };
  state.history = [];
  state.decode = null;
  state.shown = load;
  draw();
  status(`encoding ${name}… (a click now is decoded once it is encoded)`, 'busy');
  const t0 = performance.now();
  state.encoding = (state.config.encode === 'server' ? encodeOnServer(file) : encodeInPage(ctx)).then((features) => {
    if (load !== state.load) return null;  // a newer image took over: these features are never used
    state.features = { ...features, load };
    state.encodeMs = performance.now() - t0;
    status(`${name} encoded in ${state.encodeMs.toFixed(0)} ms: click (foreground), shift-click (background) or drag a box`);
    return state.features;
  });
  await state.encoding;
}

function clearImage() {
  state.shown = 0;
  state.image = null;
  state.prompt = { points: [], box: null };
  state.history = [];
  for (const id of ['image', 'overlay']) {
    const canvas = $(id);
    canvas.getContext('2d').clearRect(0, 0, canvas.width, canvas.height);
  }
  draw();
}

async function encodeInPage(ctx) {
  const rgba = ctx.getImageData(0, 0, state.width, state.height).data;
  const size = state.size;
  const pixels = normalize(resizeBilinear(rgba, state.width, state.height, size, size), size, IMAGENET);
  const input = state.encoder.inputNames[0];
  const feeds = { [input]: new ort.Tensor('float32', pixels, [1, 3, size, size]) };
  checked(program('encoder'), feeds);
  const out = await state.encoder.run(feeds);
  const [embeddings, hr0, hr1] = state.encoder.outputNames.map((n) => out[n]);
  return { image_embeddings: embeddings, hr0, hr1 };
}

async function encodeOnServer(file) {
  const response = await fetch('/api/encode', { method: 'POST', body: file });
  if (!response.ok) {
    const why = await response.json().then((j) => j.error, () => `HTTP ${response.status}`);
    throw new Error(`${file.name || 'the image'}: the server refused it: ${why}`);
  }
  const buffer = await response.arrayBuffer();
  const headerBytes = new DataView(buffer).getUint32(0, true);
  const header = JSON.parse(new TextDecoder().decode(new Uint8Array(buffer, 4, headerBytes)));
  const base = 4 + headerBytes;
  const tensors = {};
  for (const t of header.tensors) {
    tensors[t.name] = new ort.Tensor('float32', new Float32Array(buffer, base + t.offset, t.bytes / 4), t.shape);
  }
  return tensors;
}

// ---- prompts and decoding ---------------------------------------------------------------------

let decodes = 0;  // only the latest decode's mask is drawn

async function decode(clickedAt = performance.now()) {
  const load = state.shown;
  const turn = ++decodes;
  const prompt = structuredClone(state.prompt);
  if (!prompt.points.length && !prompt.box) {
    state.decode = null;
    draw();
    return;
  }
  let features = state.features;
  if (!features || features.load !== load) {  // this image is still encoding: wait for its own features
    if (!state.encoding) return;
    state.waitedForEncoder += 1;
    status(`encoding ${state.image?.name || 'the image'}… the click is decoded when it is done`, 'busy');
    features = await state.encoding;
    if (!features || features.load !== load || load !== state.load) return;  // another image took over
  }
  const size = state.size;
  const frame = (x, y) => toModelFrame(x, y, state.width, state.height, size);
  const modelPrompt = fitPrompt({
    points: prompt.points.map((p) => ({ ...frame(p.x, p.y), label: p.label })),
    box: prompt.box && (() => {
      const a = frame(prompt.box.x0, prompt.box.y0), b = frame(prompt.box.x1, prompt.box.y1);
      return { x0: a.x, y0: a.y, x1: b.x, y1: b.y };
    })(),
  }, state.tokens);
  const sparse = composeTokens(state.tables, modelPrompt, state.tokens, size);
  const C = state.tables.not_a_point.length;
  const grid = size / 16;
  const feeds = {
    image_embeddings: features.image_embeddings,
    image_pe: new ort.Tensor('float32', state.tables.image_pe, [1, C, grid, grid]),
    sparse: new ort.Tensor('float32', sparse, [1, 1, state.tokens, C]),
    dense: new ort.Tensor('float32', state.tables.dense, [1, C, grid, grid]),
    hr0: features.hr0,
    hr1: features.hr1,
  };
  checked(program('decoder'), feeds);  // a mismatched prompt is refused here, in Kestrel's words
  const t0 = performance.now();
  const out = await state.decoder.run(feeds);
  const ms = performance.now() - t0;
  if (load !== state.load || turn !== decodes) return;  // a newer image or a newer click: not drawn
  const masks = out[state.decoder.outputNames[0]];
  const iou = out[state.decoder.outputNames[1]].data;
  let best = 0;
  for (let i = 1; i < iou.length; i++) if (iou[i] > iou[best]) best = i;
  const [, , h, w] = masks.dims;
  const logits = masks.data.slice(best * h * w, (best + 1) * h * w);
  state.decode = { logits, h, w, best, iou: Array.from(iou), usedPoints: modelPrompt.points.length, load,
                   mask: upsample(logits, h, w, state.height, state.width) };
  draw();
  const total = performance.now() - clickedAt;
  state.decodeMs.push(ms);
  state.clickMs.push(total);
  status(`mask ${best + 1} of 3 · predicted IoU ${iou[best].toFixed(3)} · ${total.toFixed(0)} ms from the click to the ` +
         `mask (decoder ${ms.toFixed(1)} ms)` +
         (modelPrompt.points.length < prompt.points.length
           ? ` · using the ${modelPrompt.points.length} most recent point(s) of ${prompt.points.length}` : ''));
}

// Bilinear resize of low-resolution logits to the image (align_corners=False, as torch's
// interpolate), thresholded at 0: Uint8Array height x width of 0/1.
export function upsample(logits, h, w, outH, outW) {
  const mask = new Uint8Array(outH * outW);
  const sy = h / outH, sx = w / outW;
  for (let y = 0; y < outH; y++) {
    const fy = Math.max((y + 0.5) * sy - 0.5, 0);
    const y0 = Math.min(Math.floor(fy), h - 1), y1 = Math.min(y0 + 1, h - 1), ly = fy - y0;
    for (let x = 0; x < outW; x++) {
      const fx = Math.max((x + 0.5) * sx - 0.5, 0);
      const x0 = Math.min(Math.floor(fx), w - 1), x1 = Math.min(x0 + 1, w - 1), lx = fx - x0;
      const v = (1 - ly) * ((1 - lx) * logits[y0 * w + x0] + lx * logits[y0 * w + x1]) +
                ly * ((1 - lx) * logits[y1 * w + x0] + lx * logits[y1 * w + x1]);
      mask[y * outW + x] = v > 0 ? 1 : 0;
    }
  }
  return mask;
}

function change(update, clickedAt = performance.now()) {
  state.history.push(structuredClone(state.prompt));
  update(state.prompt);
  draw();  // the prompt shows at once, the mask when it is decoded
  return decode(clickedAt);
}

// ---- drawing and input ------------------------------------------------------------------------

// The mask's fill: of three bright colours, the one farthest from the image's mean colour under the mask.
const FILLS = [[255, 0, 200], [0, 230, 255], [255, 225, 0]];
function fillFor(mask) {
  const pixels = $('image').getContext('2d', { willReadFrequently: true }).getImageData(0, 0, state.width, state.height).data;
  const sum = [0, 0, 0];
  let n = 0;
  for (let i = 0; i < mask.length; i += 7) {
    if (mask[i]) { sum[0] += pixels[i * 4]; sum[1] += pixels[i * 4 + 1]; sum[2] += pixels[i * 4 + 2]; n++; }
  }
  const mean = sum.map((v) => v / Math.max(n, 1));
  const dist = (c) => c.reduce((d, v, k) => d + (v - mean[k]) ** 2, 0);
  return FILLS.reduce((best, c) => (dist(c) > dist(best) ? c : best));
}

// The mask as an image: a translucent contrasting fill, and an outline (white inside, black outside the
// edge) that shows on light and dark objects alike.
function maskImage(ctx, mask) {
  const W = state.width, H = state.height;
  const img = ctx.createImageData(W, H);
  const d = img.data;
  const [r, g, b] = fillFor(mask);
  const thick = Math.max(1, Math.round(Math.max(W, H) / 500));
  const edge = (x, y) => {  // a mask pixel with a neighbour outside the mask, within `thick`
    for (let k = 1; k <= thick; k++) {
      if (x < k || y < k || x >= W - k || y >= H - k) return true;
      if (!mask[y * W + x - k] || !mask[y * W + x + k] || !mask[(y - k) * W + x] || !mask[(y + k) * W + x]) return true;
    }
    return false;
  };
  const nearMask = (x, y) => {
    for (let k = 1; k <= thick; k++) {
      if ((x >= k && mask[y * W + x - k]) || (x < W - k && mask[y * W + x + k]) ||
          (y >= k && mask[(y - k) * W + x]) || (y < H - k && mask[(y + k) * W + x])) return true;
    }
    return false;
  };
  for (let y = 0; y < H; y++) {
    for (let x = 0; x < W; x++) {
      const i = y * W + x, o = i * 4;
      if (mask[i]) {
        if (edge(x, y)) { d[o] = d[o + 1] = d[o + 2] = 255; d[o + 3] = 255; }
        else { d[o] = r; d[o + 1] = g; d[o + 2] = b; d[o + 3] = 115; }
      } else if (nearMask(x, y)) {
        d[o] = d[o + 1] = d[o + 2] = 0; d[o + 3] = 255;
      }
    }
  }
  return img;
}

function draw(dragBox = null) {
  const canvas = $('overlay');
  const ctx = canvas.getContext('2d');
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  if (state.decode && state.decode.load === state.shown && state.showMask) {
    if (state.decode.image === undefined) state.decode.image = maskImage(ctx, state.decode.mask);
    ctx.putImageData(state.decode.image, 0, 0);
  }
  const r = Math.max(4, Math.round(Math.max(state.width, state.height) / 120));
  for (const p of state.prompt.points) {
    ctx.beginPath();
    ctx.arc(p.x, p.y, r, 0, 2 * Math.PI);
    ctx.fillStyle = p.label === FOREGROUND ? '#22c55e' : '#ef4444';
    ctx.fill();
    ctx.lineWidth = Math.max(1, r / 3);
    ctx.strokeStyle = '#fff';
    ctx.stroke();
  }
  for (const b of [state.prompt.box, dragBox].filter(Boolean)) {
    ctx.lineWidth = Math.max(2, r / 2);
    ctx.strokeStyle = '#facc15';
    ctx.strokeRect(b.x0, b.y0, b.x1 - b.x0, b.y1 - b.y0);
  }
  $('undo').disabled = !state.history.length;
  $('clear').disabled = !state.prompt.points.length && !state.prompt.box;
  $('download').disabled = !state.decode;
  $('show-mask').disabled = !state.decode;
}

function imagePoint(event) {
  const rect = $('overlay').getBoundingClientRect();
  return {
    x: ((event.clientX - rect.left) / rect.width) * state.width,
    y: ((event.clientY - rect.top) / rect.height) * state.height,
  };
}

let press = null;
function onDown(event) {
  if (!state.shown || state.shown !== state.load) return;  // no image, or the next one is still opening
  press = { start: imagePoint(event), shift: event.shiftKey, clientX: event.clientX, clientY: event.clientY };
}
function dragged(event) {
  return press && Math.hypot(event.clientX - press.clientX, event.clientY - press.clientY) > DRAG_PIXELS;
}
function boxFrom(a, b) {
  return { x0: Math.min(a.x, b.x), y0: Math.min(a.y, b.y), x1: Math.max(a.x, b.x), y1: Math.max(a.y, b.y) };
}
function onMove(event) {
  if (dragged(event)) draw(boxFrom(press.start, imagePoint(event)));
}
function onUp(event) {
  if (!press) return;
  const clickedAt = performance.now();
  const p = press;
  const isDrag = dragged(event);
  press = null;
  if (isDrag) {
    const box = boxFrom(p.start, imagePoint(event));
    return change((prompt) => { prompt.box = box; }, clickedAt);
  }
  const label = p.shift ? BACKGROUND : FOREGROUND;
  return change((prompt) => { prompt.points.push({ ...p.start, label }); }, clickedAt);
}

function downloadMask() {
  if (!state.decode || state.decode.load !== state.shown) return;
  const canvas = document.createElement('canvas');
  canvas.width = state.width;
  canvas.height = state.height;
  const ctx = canvas.getContext('2d');
  const img = ctx.createImageData(state.width, state.height);
  const { mask } = state.decode;
  for (let i = 0; i < mask.length; i++) {
    const v = mask[i] ? 255 : 0;
    img.data[i * 4] = img.data[i * 4 + 1] = img.data[i * 4 + 2] = v;
    img.data[i * 4 + 3] = 255;
  }
  ctx.putImageData(img, 0, 0);
  const a = document.createElement('a');
  a.href = canvas.toDataURL('image/png');
  a.download = `${(state.image?.name || 'image').replace(/\.[^.]*$/, '')}_mask.png`;
  a.click();
}

function fail(error) {
  console.error(error);
  status(`error: ${error.message}`, 'error');
}

function wire() {
  const overlay = $('overlay');
  overlay.addEventListener('pointerdown', onDown);
  overlay.addEventListener('pointermove', onMove);
  overlay.addEventListener('pointerup', (e) => Promise.resolve(onUp(e)).catch(fail));
  $('open').addEventListener('click', () => $('file').click());
  $('file').addEventListener('change', (e) => e.target.files[0] && openImage(e.target.files[0]).catch(fail));
  $('undo').addEventListener('click', () => {
    state.prompt = state.history.pop();
    decode().catch(fail);
  });
  $('clear').addEventListener('click', () => change((prompt) => { prompt.points = []; prompt.box = null; }).catch(fail));
  $('download').addEventListener('click', downloadMask);
  $('show-mask').addEventListener('change', (e) => { state.showMask = e.target.checked; draw(); });
  document.addEventListener('keydown', (e) => {
    const typing = e.target.matches?.('input:not([type=checkbox]):not([type=file]), textarea');
    if (e.key === 'm' && !e.ctrlKey && !e.metaKey && !e.altKey && !typing) {
      $('show-mask').checked = !$('show-mask').checked;
      state.showMask = $('show-mask').checked;
      draw();
    }
  });
  const stage = $('stage');
  stage.addEventListener('dragover', (e) => { e.preventDefault(); stage.classList.add('drop'); });
  stage.addEventListener('dragleave', () => stage.classList.remove('drop'));
  stage.addEventListener('drop', (e) => {
    e.preventDefault();
    stage.classList.remove('drop');
    const file = e.dataTransfer.files[0];
    if (file && state.decoder) openImage(file).catch(fail);
  });
}

wire();
state.ready = start().then(() => true, (e) => { fail(e); return false; });
