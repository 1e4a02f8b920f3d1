// A knnper device in the browser: the portable predictor of one bundle
// (`knnper-edge export-onnx BUNDLE --out predictor-app.onnx --keys-as-inputs`) run by
// onnxruntime-web, which predicts raw images and learns from labelled ones as Runtime.add does:
// it appends the graph's "key" output (already in the form the bundle stores) and the label,
// then keeps the newest `capacity` keys, as predictor-app.onnx.app.json says.

export class Device {
  constructor(ort, session, contract, keys, labels) {
    this.ort = ort;
    this.session = session;
    this.contract = contract; // null for a self-contained predictor (no keys as inputs)
    this.keys = keys; // Float32Array [n * keyDim]
    this.labels = labels; // BigInt64Array [n]
  }

  // modelUrl: the .onnx file; with `learns` also its .keys.f32, .labels.i64 and .app.json.
  static async load(ort, modelUrl, { learns = true } = {}) {
    const model = await fetchBytes(modelUrl);
    const session = await ort.InferenceSession.create(model, { executionProviders: ["wasm"] });
    if (!learns) return new Device(ort, session, null, null, null);
    const [keys, labels, contract] = await Promise.all([
      fetchBytes(`${modelUrl}.keys.f32`),
      fetchBytes(`${modelUrl}.labels.i64`),
      fetch(`${modelUrl}.app.json`).then(checked).then((r) => r.json()),
    ]);
    return new Device(ort, session, contract, new Float32Array(keys.buffer),
                      new BigInt64Array(labels.buffer));
  }

  get size() {
    return this.labels ? this.labels.length : 0;
  }

  // pixels: Uint8Array of raw images, shape [n, H, W, C] -> { probabilities, key } (flat)
  async run(pixels, shape) {
    const feeds = { input: new this.ort.Tensor("uint8", pixels, shape) };
    if (this.contract) {
      const dim = this.contract.key_dim;
      feeds.keys = new this.ort.Tensor("float32", this.keys, [this.size, dim]);
      feeds.labels = new this.ort.Tensor("int64", this.labels, [this.size]);
    }
    const out = await this.session.run(feeds, ["probabilities", "key"]);
    return { probabilities: out.probabilities.data, key: out.key.data };
  }

  async predict(pixels, shape) {
    return (await this.run(pixels, shape)).probabilities;
  }

  // Learn labelled images as Runtime.add does (the app contract in the .app.json).
  async learn(pixels, shape, labels) {
    const { update_strategy: strategy, capacity, key_dim: dim } = this.contract;
    if (strategy === "fixed") return;
    const n = shape[0];
    const { key } = await this.run(pixels, shape);
    const keys = new Float32Array(this.keys.length + key.length);
    keys.set(this.keys);
    keys.set(key, this.keys.length);
    const all = new BigInt64Array(this.size + n);
    all.set(this.labels);
    all.set(labels.map(BigInt), this.size);
    const first = Math.max(0, all.length - capacity); // the oldest go first
    this.keys = keys.slice(first * dim);
    this.labels = all.slice(first);
  }
}

function checked(response) {
  if (!response.ok) throw new Error(`${response.url}: HTTP ${response.status}`);
  return response;
}

async function fetchBytes(url) {
  return new Uint8Array(await (await fetch(url).then(checked)).arrayBuffer());
}
