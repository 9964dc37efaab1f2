// Image preprocessing for the SAM 2.1 edge encoder, bit for bit as Kestrel's Python recipe:
// RGB, resize to size x size without keeping the aspect (Pillow's bilinear filter), /255,
// ImageNet mean/std, float32 [1, 3, size, size].
//
// The resize is Pillow's two-pass convolution (horizontal then vertical, 8-bit between passes,
// 22-bit fixed-point weights), so the page feeds the encoder exactly the tensor Python would.

const PRECISION_BITS = 32 - 8 - 2;

function bilinear(x) {
  x = Math.abs(x);
  return x < 1 ? 1 - x : 0;
}

// Pillow's precompute_coeffs for one axis: per output index, the first input index, the count,
// and the fixed-point weights.
function coefficients(inSize, outSize) {
  const scale = inSize / outSize;
  const filterScale = Math.max(scale, 1);
  const support = 1.0 * filterScale;
  const ksize = Math.ceil(support) * 2 + 1;
  const bounds = new Int32Array(outSize * 2);
  const weights = new Int32Array(outSize * ksize);
  const w = new Float64Array(ksize);
  for (let xx = 0; xx < outSize; xx++) {
    const center = (xx + 0.5) * scale;
    const ss = 1 / filterScale;
    const xmin = Math.max(Math.trunc(center - support + 0.5), 0);
    const xmax = Math.min(Math.trunc(center + support + 0.5), inSize) - xmin;
    let total = 0;
    for (let x = 0; x < xmax; x++) {
      w[x] = bilinear((x + xmin - center + 0.5) * ss);
      total += w[x];
    }
    for (let x = 0; x < xmax; x++) {
      const k = total !== 0 ? w[x] / total : w[x];
      weights[xx * ksize + x] = Math.trunc(k < 0 ? -0.5 + k * (1 << PRECISION_BITS) : 0.5 + k * (1 << PRECISION_BITS));
    }
    bounds[xx * 2] = xmin;
    bounds[xx * 2 + 1] = xmax;
  }
  return { bounds, weights, ksize };
}

function clip8(v) {
  const s = v >> PRECISION_BITS;
  return s < 0 ? 0 : s > 255 ? 255 : s;
}

function horizontalPass(src, w, h, outW) {
  const hor = coefficients(w, outW);
  const out = new Uint8Array(outW * h * 3);
  for (let yy = 0; yy < h; yy++) {
    const row = yy * w * 3;
    for (let xx = 0; xx < outW; xx++) {
      const xmin = hor.bounds[xx * 2], xmax = hor.bounds[xx * 2 + 1], k = xx * hor.ksize;
      let s0 = 1 << (PRECISION_BITS - 1), s1 = s0, s2 = s0;
      for (let x = 0; x < xmax; x++) {
        const p = row + (x + xmin) * 3, c = hor.weights[k + x];
        s0 += src[p] * c; s1 += src[p + 1] * c; s2 += src[p + 2] * c;
      }
      const o = (yy * outW + xx) * 3;
      out[o] = clip8(s0); out[o + 1] = clip8(s1); out[o + 2] = clip8(s2);
    }
  }
  return out;
}

function verticalPass(src, w, h, outH) {
  const vert = coefficients(h, outH);
  const out = new Uint8Array(w * outH * 3);
  for (let yy = 0; yy < outH; yy++) {
    const ymin = vert.bounds[yy * 2], ymax = vert.bounds[yy * 2 + 1], k = yy * vert.ksize;
    for (let xx = 0; xx < w; xx++) {
      let s0 = 1 << (PRECISION_BITS - 1), s1 = s0, s2 = s0;
      for (let y = 0; y < ymax; y++) {
        const p = ((y + ymin) * w + xx) * 3, c = vert.weights[k + y];
        s0 += src[p] * c; s1 += src[p + 1] * c; s2 += src[p + 2] * c;
      }
      const o = (yy * w + xx) * 3;
      out[o] = clip8(s0); out[o + 1] = clip8(s1); out[o + 2] = clip8(s2);
    }
  }
  return out;
}

// rgba: Uint8ClampedArray (width x height x 4) -> Uint8Array RGB (outW x outH x 3), as
// PIL.Image.resize((outW, outH), Image.BILINEAR) on the RGB image. Like Pillow, an image that is
// widened and made shorter is resampled vertically first, any other horizontally first (the 8-bit
// rounding between the passes makes the order visible).
export function resizeBilinear(rgba, width, height, outW, outH) {
  const src = new Uint8Array(width * height * 3);
  for (let i = 0, j = 0; i < width * height; i++, j += 3) {
    src[j] = rgba[i * 4]; src[j + 1] = rgba[i * 4 + 1]; src[j + 2] = rgba[i * 4 + 2];
  }
  const needH = outW !== width, needV = outH !== height;
  if (outW > width && outH < height) {
    return horizontalPass(verticalPass(src, width, height, outH), width, outH, outW);
  }
  const mid = needH ? horizontalPass(src, width, height, outW) : src;
  return needV ? verticalPass(mid, outW, height, outH) : mid;
}

// RGB uint8 (size x size x 3) -> Float32Array [1, 3, size, size]: (round32(v * rescale) - mean) / std,
// each step rounded to float32 as torch computes it.
export function normalize(rgb, size, { mean, std, rescale }) {
  const out = new Float32Array(3 * size * size);
  const plane = size * size;
  for (let c = 0; c < 3; c++) {
    const m = Math.fround(mean[c]), s = Math.fround(std[c]);
    for (let i = 0; i < plane; i++) {
      const v = Math.fround(rgb[i * 3 + c] * rescale);
      out[c * plane + i] = Math.fround(Math.fround(v - m) / s);
    }
  }
  return out;
}
