// Prompt tokens for the SAM 2.1 edge decoder (seed 002), composed from the export's prompt tables
// by the same rules as Kestrel's Python composer, which equal transformers' Sam2PromptEncoder for
// every prompt that fits:
//
//   points only:     one token per point (Gaussian positional code + the label's embedding), then
//                    one not-a-point token;
//   a box:           the top-left corner, the bottom-right corner, one not-a-point token;
//   points and box:  the points, then the box's three tokens;
//   padding:         not-a-point tokens up to the decoder's fixed count (the decoder masks every
//                    not-a-point that follows another, so padding never changes the result).
//
// A prompt with more tokens than the decoder takes is composed as the seed says the site does:
// the page keeps the box and the most recent points that fit, and drops the oldest points first
// (`fitPrompt`). Coordinates are in the model frame (pixels of the size x size encoder input).
//
// Arithmetic: the positional code is computed in float64 and rounded to float32 once per element,
// then added to the float32 embedding in float32, exactly as the Python composer does, so the two
// agree bit for bit.

export const FOREGROUND = 1;
export const BACKGROUND = 0;

// tables: {gaussian: Float32Array(2 * C/2), point_fg, point_bg, box_tl, box_br, not_a_point: Float32Array(C)}
export function positionalCode(tables, x, y, size) {
  const g = tables.gaussian;
  const half = g.length / 2;
  const cx = 2 * ((x + 0.5) / size) - 1;
  const cy = 2 * ((y + 0.5) / size) - 1;
  const out = new Float32Array(2 * half);
  for (let j = 0; j < half; j++) {
    const angle = 2 * Math.PI * (cx * g[j] + cy * g[half + j]);
    out[j] = Math.sin(angle);
    out[half + j] = Math.cos(angle);
  }
  return out;
}

function embedded(tables, x, y, size, embedding) {
  const code = positionalCode(tables, x, y, size);
  for (let i = 0; i < code.length; i++) code[i] = Math.fround(code[i] + embedding[i]);
  return code;
}

// How many tokens a prompt takes: points, then 1 not-a-point (no box) or the box's 3 tokens.
export function tokenCount(prompt) {
  return prompt.points.length + (prompt.box ? 3 : 1);
}

// The part of a prompt that fits in `count` tokens: the box, and the most recent points.
export function fitPrompt(prompt, count) {
  const room = count - (prompt.box ? 3 : 1);
  if (room < 0) throw new Error(`a box needs 3 prompt tokens; this decoder takes ${count}`);
  const points = room === 0 ? [] : prompt.points.slice(-room);
  return { points, box: prompt.box };
}

// prompt: {points: [{x, y, label}], box: {x0, y0, x1, y1} | null} in the model frame.
// Returns Float32Array [count * C]: the decoder's `sparse` input [1, 1, count, C].
export function composeTokens(tables, prompt, count, size) {
  if (tokenCount(prompt) > count) {
    throw new Error(`prompt takes ${tokenCount(prompt)} tokens; this decoder takes ${count} (use fitPrompt)`);
  }
  const C = tables.not_a_point.length;
  const out = new Float32Array(count * C);
  let t = 0;
  for (const p of prompt.points) {
    if (p.label !== FOREGROUND && p.label !== BACKGROUND) throw new Error(`point label must be 0 or 1, got ${p.label}`);
    out.set(embedded(tables, p.x, p.y, size, p.label === FOREGROUND ? tables.point_fg : tables.point_bg), t++ * C);
  }
  if (prompt.box) {
    const b = prompt.box;
    out.set(embedded(tables, b.x0, b.y0, size, tables.box_tl), t++ * C);
    out.set(embedded(tables, b.x1, b.y1, size, tables.box_br), t++ * C);
  }
  while (t < count) out.set(tables.not_a_point, t++ * C);
  return out;
}

// Original image pixels -> model frame (the encoder input is the image resized to size x size).
export function toModelFrame(x, y, width, height, size) {
  return { x: x * (size / width), y: y * (size / height) };
}
