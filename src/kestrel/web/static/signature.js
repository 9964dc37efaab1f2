// The typed signature an exported program carries (`kestrel export` writes it in the manifest's program
// row and in the ONNX file's metadata_props; kestrel.runtime.signature is the Python side), checked in
// the page before onnxruntime-web runs a call.
//
// checkCall(signature, feeds, file) binds the entry's generics from the inputs, in order, with the rule
// of Kestrel's eager entries and of kestrel.exported.load: an axis that is a dynamic generic binds it
// the first time and must equal it after; a fixed generic (bound at export) and a generic of the model
// must equal their value; an axis written as an expression (`3 * Pts`) must equal it evaluated. A
// mismatch throws a SignatureError in the same words as Python, naming the generic, both values and the
// input that bound it first ("sparse has B = 2, image_embeddings has B = 1").

export class SignatureError extends Error {
  constructor(message) {
    super(message);
    this.name = 'SignatureError';
  }
}

const ORT_DTYPES = { float32: 'f32', float64: 'f64', float16: 'f16', int32: 'i32', int64: 'i64', bool: 'bool' };
const EXPORTED = 'the export';

// ---- dimension expressions in the seeds' notation ----------------------------------------------
// integers, generic names, + - * / (floor division) % and parentheses, min(a, b), max(a, b)

function tokenize(text) {
  const tokens = [];
  const re = /\s*(?:(\d+)|([A-Za-z_][A-Za-z0-9_]*)|(==|>=|<=|[-+*/%(),<>]))/y;
  let i = 0;
  text = text.trim();
  while (i < text.length) {
    re.lastIndex = i;
    const m = re.exec(text);
    if (!m) throw new SignatureError(`cannot read the expression ${JSON.stringify(text)} at column ${i}`);
    tokens.push(m[1] !== undefined ? { num: Number(m[1]) } : m[2] !== undefined ? { name: m[2] } : { op: m[3] });
    i = re.lastIndex;
    while (i < text.length && text[i] === ' ') i++;
  }
  return tokens;
}

const floorDiv = (a, b) => Math.floor(a / b);
const floorMod = (a, b) => a - b * Math.floor(a / b);

// The value of an expression at `env` (name -> int); null if a name is not bound.
export function evaluate(text, env) {
  const tokens = tokenize(String(text));
  let i = 0;
  const peek = () => tokens[i];
  const take = (op) => (tokens[i] && tokens[i].op === op ? (i++, true) : false);
  const lift = (f) => (a, b) => (a === null || b === null ? null : f(a, b));
  const ops = { '+': lift((a, b) => a + b), '-': lift((a, b) => a - b), '*': lift((a, b) => a * b),
                '/': lift(floorDiv), '%': lift(floorMod) };
  function primary() {
    const t = peek();
    if (!t) throw new SignatureError(`expression ${JSON.stringify(text)} ends early`);
    i++;
    if (t.num !== undefined) return t.num;
    if (t.op === '-') { const v = primary(); return v === null ? null : -v; }
    if (t.op === '(') { const v = expr(); if (!take(')')) throw new SignatureError(`missing ) in ${text}`); return v; }
    if (t.name === 'min' || t.name === 'max') {
      if (!take('(')) throw new SignatureError(`expected ( after ${t.name} in ${text}`);
      const a = expr();
      take(',');
      const b = expr();
      take(')');
      return a === null || b === null ? null : Math[t.name](a, b);
    }
    if (t.name !== undefined) return Object.hasOwn(env, t.name) ? env[t.name] : null;
    throw new SignatureError(`unexpected ${t.op} in ${JSON.stringify(text)}`);
  }
  function term() {
    let v = primary();
    while (peek() && ['*', '/', '%'].includes(peek().op)) { const op = tokens[i++].op; v = ops[op](v, primary()); }
    return v;
  }
  function expr() {
    let v = term();
    while (peek() && ['+', '-'].includes(peek().op)) { const op = tokens[i++].op; v = ops[op](v, term()); }
    return v;
  }
  const v = expr();
  if (i !== tokens.length) throw new SignatureError(`cannot read ${JSON.stringify(text)} past token ${i}`);
  return v;
}

function names(text) {
  return tokenize(String(text)).filter((t) => t.name && t.name !== 'min' && t.name !== 'max').map((t) => t.name);
}

// The declared axes of `Tensor[B, Hd, 64, 64; T]`: ["B", "Hd", "64", "64"] (top-level commas only).
function declaredAxes(type) {
  const inner = type.slice(type.indexOf('[') + 1, type.lastIndexOf(';'));
  const out = [];
  let depth = 0, start = 0;
  for (let k = 0; k < inner.length; k++) {
    const c = inner[k];
    if (c === '(') depth++;
    else if (c === ')') depth--;
    else if (c === ',' && depth === 0) { out.push(inner.slice(start, k).trim()); start = k + 1; }
  }
  if (inner.trim()) out.push(inner.slice(start).trim());
  return out;
}

const isName = (text) => /^[A-Za-z_][A-Za-z0-9_]*$/.test(String(text));

// ---- facts: `a > b`, `a >= b`, `a == b`, `a < b`, `a <= b` --------------------------------------

function factHolds(fact, env) {
  const m = /^(.*?)(==|>=|<=|>|<)(.*)$/.exec(fact);
  if (!m) return null;
  const a = evaluate(m[1], env), b = evaluate(m[3], env);
  if (a === null || b === null) return null;
  return { '==': a === b, '>=': a >= b, '<=': a <= b, '>': a > b, '<': a < b }[m[2]];
}

// ---- the check --------------------------------------------------------------------------------

// feeds: {name: onnxruntime-web Tensor (or {dims, type})}. Returns the entry's generics bound.
export function checkCall(signature, feeds, file = '') {
  const prefix = `${signature.model}.${signature.entry}${file ? ` (${file})` : ''}: `;
  const bound = signature.bound;
  const model = Object.fromEntries(Object.entries(bound).filter(([, v]) => typeof v === 'number'));
  const binding = { ...signature.fixed };
  const source = Object.fromEntries(Object.keys(signature.fixed).map((k) => [k, EXPORTED]));
  const dynamic = new Set(signature.dynamic);
  const inputs = signature.inputs.map((p) => p.name);
  for (const name of Object.keys(feeds)) {
    if (!inputs.includes(name)) throw new SignatureError(`${prefix}has no input ${JSON.stringify(name)}; its inputs are ${inputs.join(', ')}`);
  }
  for (const port of signature.inputs) {
    const feed = feeds[port.name];
    if (!feed) throw new SignatureError(`${prefix}missing input ${port.name}`);
    const dims = Array.from(feed.dims, Number);
    const dtype = ORT_DTYPES[feed.type] ?? feed.type;
    const raw = declaredAxes(port.type);
    const tail = `: input ${port.name} has shape (${dims.join(', ')}${dims.length === 1 ? ',' : ''}) and dtype ${dtype}, ` +
                 `declared ${port.type}`;
    const fail = (why) => { throw new SignatureError(prefix + why + tail); };
    if (dims.length !== port.shape.length) fail(`${port.name} has ${dims.length} axes, declared ${port.shape.length}`);
    for (let axis = 0; axis < dims.length; axis++) {
      const got = dims[axis];
      const declared = port.shape[axis];
      const text = raw[axis] ?? String(declared);
      if (isName(text) && dynamic.has(text) && !Object.hasOwn(binding, text)) {
        binding[text] = got;
        source[text] = port.name;
        continue;
      }
      const want = typeof declared === 'number' ? declared : evaluate(declared, binding);
      if (want === null) {
        fail(`${port.name} axis ${axis}: cannot infer ${names(declared).filter((n) => !Object.hasOwn(binding, n)).join(', ')} from ${got}`);
      }
      if (want === got) continue;
      if (isName(text) && Object.hasOwn(source, text)) {
        if (source[text] === EXPORTED) {
          fail(`${port.name} has ${text} = ${got}, but the program was exported with ${text} = ${binding[text]} ` +
               `(fixed at export; an ONNX export with --dynamic ${text} keeps it dynamic)`);
        }
        fail(`${port.name} has ${text} = ${got}, ${source[text]} has ${text} = ${binding[text]}`);
      }
      if (isName(text) && Object.hasOwn(bound, text)) fail(`${port.name} has ${text} = ${got}, the model binds ${text} = ${bound[text]}`);
      const said = names(text).filter((n) => Object.hasOwn(binding, n) || Object.hasOwn(model, n))
        .map((n) => (Object.hasOwn(binding, n) ? `${n} = ${binding[n]} from ${source[n] ?? 'the model'}`
                                                 : `${n} = ${model[n]} from the model`));
      fail(`${port.name} axis ${axis} is ${got}, declared ${text} = ${want}` + (said.length ? ` (${said.join(', ')})` : ''));
    }
    if (dtype !== port.dtype) {
      const t = port.type.slice(port.type.lastIndexOf(';') + 1, port.type.lastIndexOf(']')).trim();
      fail(`${port.name} has dtype ${dtype}, declared ${t}` + (t !== port.dtype ? ` = ${port.dtype}` : ''));
    }
  }
  for (const name of signature.dynamic) {
    if ((binding[name] ?? 1) < 1) {
      throw new SignatureError(`${prefix}${name} is ${binding[name]} (from ${source[name]}): empty axes are not supported ` +
                               '(every entry dim is at least 1)');
    }
  }
  const env = { ...model, ...binding };
  for (const fact of signature.where) {
    const used = names(fact.replace(/==|>=|<=|>|</, ' '));
    if (!used.some((n) => dynamic.has(n))) continue;
    if (factHolds(fact, env) === false) {
      const said = [...new Set(used)].sort().map((n) => `${n} = ${env[n]}`).join(', ');
      throw new SignatureError(`${prefix}\`where ${fact}\` does not hold for ${said}`);
    }
  }
  return Object.fromEntries(signature.generics.map(([n]) => n).filter((n) => Object.hasOwn(binding, n)).map((n) => [n, binding[n]]));
}
