// What an image file is, from its bytes, before the browser decodes it: its format and its width x
// height as the header states them. The server reads the same fields (kestrel.web.server.image_size),
// so the page and the server refuse the same images with the same message.

export const ACCEPTED = ['png', 'jpeg', 'gif', 'bmp', 'webp'];
const NAMES = { png: 'PNG', jpeg: 'JPEG', gif: 'GIF', bmp: 'BMP', webp: 'WebP' };

// Formats recognised only to name them in the refusal.
const OTHERS = [
  [[0x49, 0x49, 0x2a, 0x00], 'TIFF'], [[0x4d, 0x4d, 0x00, 0x2a], 'TIFF'], [[0x25, 0x50, 0x44, 0x46], 'PDF'],
  [[0x00, 0x00, 0x01, 0x00], 'ICO'], [[0x3c, 0x3f, 0x78, 0x6d], 'XML/SVG'], [[0x3c, 0x73, 0x76, 0x67], 'SVG'],
  [[0x50, 0x4b, 0x03, 0x04], 'ZIP'],
];

function starts(bytes, magic, at = 0) {
  return magic.every((b, i) => bytes[at + i] === b);
}

export function imageFormat(bytes) {
  if (starts(bytes, [0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a])) return 'png';
  if (starts(bytes, [0xff, 0xd8, 0xff])) return 'jpeg';
  if (starts(bytes, [0x47, 0x49, 0x46, 0x38])) return 'gif';
  if (starts(bytes, [0x42, 0x4d])) return 'bmp';
  if (starts(bytes, [0x52, 0x49, 0x46, 0x46]) && starts(bytes, [0x57, 0x45, 0x42, 0x50], 8)) return 'webp';
  return null;
}

function otherFormat(bytes) {
  if (starts(bytes, [0x66, 0x74, 0x79, 0x70], 4)) {  // ISO media: HEIC, AVIF
    const brand = String.fromCharCode(...bytes.slice(8, 12));
    return brand.startsWith('avi') ? 'AVIF' : brand.startsWith('he') || brand.startsWith('mif') ? 'HEIC' : 'ISO media';
  }
  const hit = OTHERS.find(([magic]) => starts(bytes, magic));
  return hit ? hit[1] : null;
}

// { width, height } from the header, or null where it is cut short.
export function headerSize(bytes, format) {
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  try {
    if (format === 'png' && starts(bytes, [0x49, 0x48, 0x44, 0x52], 12)) {
      return { width: view.getUint32(16), height: view.getUint32(20) };
    }
    if (format === 'gif') return { width: view.getUint16(6, true), height: view.getUint16(8, true) };
    if (format === 'bmp') return { width: Math.abs(view.getInt32(18, true)), height: Math.abs(view.getInt32(22, true)) };
    if (format === 'webp') {
      const kind = String.fromCharCode(...bytes.slice(12, 16));
      if (kind === 'VP8 ') return { width: view.getUint16(26, true) & 0x3fff, height: view.getUint16(28, true) & 0x3fff };
      if (kind === 'VP8L') {
        const bits = view.getUint32(21, true);
        return { width: (bits & 0x3fff) + 1, height: ((bits >>> 14) & 0x3fff) + 1 };
      }
      if (kind === 'VP8X') {
        const u24 = (at) => bytes[at] | (bytes[at + 1] << 8) | (bytes[at + 2] << 16);
        return { width: u24(24) + 1, height: u24(27) + 1 };
      }
    }
    if (format === 'jpeg') {
      let at = 2;
      while (at + 9 < bytes.length) {
        if (bytes[at] !== 0xff) return null;
        const marker = bytes[at + 1];
        if (marker === 0xd8 || marker === 0x01 || (marker >= 0xd0 && marker <= 0xd7)) { at += 2; continue; }
        const length = view.getUint16(at + 2);
        if (marker >= 0xc0 && marker <= 0xcf && ![0xc4, 0xc8, 0xcc].includes(marker)) {
          return { width: view.getUint16(at + 7), height: view.getUint16(at + 5) };
        }
        at += 2 + length;
      }
    }
  } catch (e) {
    if (!(e instanceof RangeError)) throw e;
  }
  return null;
}

// The same words as the server's kestrel.web.server.too_many_pixels.
export function tooManyPixels(width, height, limit) {
  const n = (x) => x.toLocaleString('en-US');
  return `${width} x ${height} = ${n(width * height)} pixels; the limit is ${n(limit)} pixels`;
}

// Check a File before decoding it. Returns { format, width, height }; throws an Error whose message
// names the file and the cause: empty, too large (bytes or pixels), not an image, unsupported format.
export async function inspectImage(file, limits) {
  const name = file.name || 'the image';
  if (file.size === 0) throw new Error(`${name} is empty (0 bytes)`);
  if (limits.maxBytes && file.size > limits.maxBytes) {
    throw new Error(`${name} is ${file.size.toLocaleString('en-US')} bytes; the limit is ` +
                    `${limits.maxBytes.toLocaleString('en-US')} bytes`);
  }
  const bytes = new Uint8Array(await file.arrayBuffer());
  const format = imageFormat(bytes);
  if (!format) {
    const other = otherFormat(bytes);
    throw new Error(other
      ? `${name} is a ${other} file; this page opens ${ACCEPTED.map((f) => NAMES[f]).join(', ')} images`
      : `${name} is not an image: its first bytes are not those of a ${ACCEPTED.map((f) => NAMES[f]).join(', ')} file`);
  }
  const size = headerSize(bytes, format);
  if (!size || !size.width || !size.height) {
    throw new Error(`${name}: its ${NAMES[format]} header is damaged or cut short (no width and height)`);
  }
  if (limits.maxPixels && size.width * size.height > limits.maxPixels) {
    throw new Error(`${name} is ${tooManyPixels(size.width, size.height, limits.maxPixels)}`);
  }
  return { format, formatName: NAMES[format], ...size };
}
