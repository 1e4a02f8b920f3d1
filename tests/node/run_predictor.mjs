// Runs a knnper portable predictor in onnxruntime-node and writes its "probabilities" output
// as raw little-endian float32 (tests/test_portable.py compares them with the Python runtime).
//   node run_predictor.mjs MODEL INPUT.u8 N,H,W,C OUT.f32 [KEYS.f32 LABELS.i64 DIM]
import { readFileSync, writeFileSync } from "node:fs";
import * as ort from "onnxruntime-node";

const [model, inputPath, shapeText, outPath, keysPath, labelsPath, dimText] = process.argv.slice(2);
const shape = shapeText.split(",").map(Number);
const pixels = new Uint8Array(readFileSync(inputPath));
const feeds = { input: new ort.Tensor("uint8", pixels, shape) };
if (keysPath) {
  const keyBytes = readFileSync(keysPath);
  const keys = new Float32Array(keyBytes.buffer, keyBytes.byteOffset, keyBytes.length / 4);
  const labelBytes = readFileSync(labelsPath);
  const labels = new BigInt64Array(labelBytes.buffer, labelBytes.byteOffset, labelBytes.length / 8);
  const dim = Number(dimText);
  feeds.keys = new ort.Tensor("float32", keys, [keys.length / dim, dim]);
  feeds.labels = new ort.Tensor("int64", labels, [labels.length]);
}
const session = await ort.InferenceSession.create(model, { intraOpNumThreads: 1 });
const result = await session.run(feeds);
const probs = result.probabilities.data;
writeFileSync(outPath, Buffer.from(probs.buffer, probs.byteOffset, probs.byteLength));
