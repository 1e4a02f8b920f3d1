// The page: loads ?model=URL (default ../../bundles/predictor-app.onnx) with its keys, turns
// the chosen image into the raw uint8 pixels the bundle declares, predicts, and learns.
import { Device } from "./knnper-device.mjs";

// imported in the try below: a static import that fails stops the module before any of it
// runs, and the page stayed at "loading..." with the error in the console only
const ORT_DIR = new URL("../../tests/browser/node_modules/onnxruntime-web/dist/", import.meta.url);

const $ = (id) => document.getElementById(id);
const modelUrl = new URLSearchParams(location.search).get("model") ??
  "../../bundles/predictor-app.onnx";
$("model").textContent = modelUrl;
let pixels = null;

function status(device) {
  $("status").textContent = `${device.size} stored keys, capacity ${device.contract.capacity}`;
}

// The image drawn at the bundle's size, as uint8 [1, H, W, C] (grey: the mean of R, G, B).
async function readImage(file, [height, width, channels]) {
  const bitmap = await createImageBitmap(file);
  const canvas = $("canvas");
  canvas.width = width;
  canvas.height = height;
  const context = canvas.getContext("2d", { willReadFrequently: true });
  context.drawImage(bitmap, 0, 0, width, height);
  const rgba = context.getImageData(0, 0, width, height).data;
  const out = new Uint8Array(height * width * channels);
  for (let i = 0; i < height * width; i++) {
    if (channels === 1) {
      out[i] = Math.round((rgba[4 * i] + rgba[4 * i + 1] + rgba[4 * i + 2]) / 3);
    } else {
      for (let c = 0; c < channels; c++) out[i * channels + c] = rgba[4 * i + c];
    }
  }
  return out;
}

try {
  let ort;
  try {
    ort = await import(new URL("ort.wasm.min.mjs", ORT_DIR).href);
  } catch (error) {
    throw new Error(`onnxruntime-web is not installed at ${ORT_DIR.pathname} (run ` +
      "`(cd tests/browser && npm install --ignore-scripts)`, docs/browser.md): " + error.message);
  }
  ort.env.wasm.numThreads = 1;
  ort.env.wasm.wasmPaths = ORT_DIR.href;
  const device = await Device.load(ort, modelUrl);
  const shape = [1, ...device.contract.input.shape];
  $("label").max = device.contract.num_classes - 1;
  status(device);
  $("image").addEventListener("change", async () => {
    pixels = await readImage($("image").files[0], device.contract.input.shape);
    $("predict").disabled = $("learn").disabled = false;
  });
  $("predict").addEventListener("click", async () => {
    const p = Array.from(await device.predict(pixels, shape));
    $("predicted").textContent = p.indexOf(Math.max(...p));
    $("probabilities").textContent = JSON.stringify(p);
  });
  $("learn").addEventListener("click", async () => {
    await device.learn(pixels, shape, [Number($("label").value)]);
    status(device);
  });
} catch (error) {
  $("status").textContent = `error: ${error.message}`;
}
