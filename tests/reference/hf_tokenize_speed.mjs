// HF tokenizers' encode speed through its Node binding (npm `tokenizers`, the Rust library), for a
// side-by-side with tokenize_bench on a machine without the Python package: the same {"text"}
// documents, untimed warm-up, then timed passes (median, p20/p80) of encode per document on one
// thread and of encodeBatch over all documents (RAYON_NUM_THREADS threads). Appends CSV rows
// (bench tokenize, provider hf_tokenizers_node) in the benchmarks' format.
//   RAYON_NUM_THREADS=2 NODE_PATH=/tmp/tokref/node_modules node tests/reference/hf_tokenize_speed.mjs \
//       tokenizer.json docs.jsonl out.csv CORPUS_NAME COMMIT [SECONDS]
import { createRequire } from 'node:module';
import fs from 'node:fs';
import os from 'node:os';

const require = createRequire(import.meta.url);
const { Tokenizer } = require('tokenizers');
const [tokPath, docsPath, csvPath, corpus, commit, secsArg] = process.argv.slice(2);
const secs = Number(secsArg ?? 5);
const threads = Number(process.env.RAYON_NUM_THREADS ?? os.cpus().length);
const tok = Tokenizer.fromFile(tokPath);
const docs = fs.readFileSync(docsPath, 'utf8').split('\n').filter((l) => l.trim()).map((l) => JSON.parse(l).text);
const mb = docs.reduce((a, d) => a + Buffer.byteLength(d), 0) / 1e6;

async function timed(fn) {
  await fn();
  const times = [];
  let total = 0, n = 0;
  while (times.length < 3 || total < secs) {
    const t0 = process.hrtime.bigint();
    n = await fn();
    const dt = Number(process.hrtime.bigint() - t0) / 1e9;
    times.push(dt);
    total += dt;
  }
  times.sort((a, b) => a - b);
  const q = (p) => times[Math.round(p * (times.length - 1))];
  return [n, q(0.5), q(0.2), q(0.8)];
}
const single = async () => {
  let n = 0;
  for (const d of docs) n += (await tok.encode(d, null, { addSpecialTokens: false })).getIds().length;
  return n;
};
const batch = async () => (await tok.encodeBatch(docs, { addSpecialTokens: false })).reduce((a, e) => a + e.getIds().length, 0);

const cpu = `cpu: ${os.cpus()[0].model}, ${os.cpus().length} threads`;
const stamp = new Date().toISOString().replace(/\.\d+Z$/, 'Z');
if (!fs.existsSync(csvPath)) fs.writeFileSync(csvPath, 'bench,kernel,provider,mode,metric,unit,shape,p50,p20,p80,noisy,gpu,commit,timestamp\n');
for (const [mode, fn, t] of [['encode', single, 1], ['encode_batch', batch, threads]]) {
  const [n, p50, p20, p80] = await timed(fn);
  const shape = `tokenizer=qwen3,threads=${t},corpus=${corpus}`;
  for (const [metric, unit, amount] of [['mb_per_s', 'MB/s', mb], ['tok_per_s', 'tok/s', n]])
    fs.appendFileSync(csvPath, `tokenize,encode,hf_tokenizers_node,${mode},${metric},${unit},"${shape}",${(amount / p50).toPrecision(6)},` +
                               `${(amount / p80).toPrecision(6)},${(amount / p20).toPrecision(6)},0,"${cpu}",${commit},${stamp}\n`);
  console.log(`HF tokenizers (node) ${mode.padEnd(12)} threads ${String(t).padStart(3)}: ${(mb / p50).toFixed(2)} MB/s  ${(n / p50).toFixed(0)} tok/s`);
}
