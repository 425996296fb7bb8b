// Runs requests through an ONNX Runtime JavaScript package (`ort`), the same way in Node.js and in a browser.
// A request: {"model": where readModel finds it, "feeds": {KEY: {"dtype", "dims", "data": base64 of little-endian bytes}}}.
// A result: {"inputNames", "outputNames", "outputs": {KEY: {"dtype", "dims", "data"}}}, or {"error"}.
const ARRAYS = {float32: Float32Array, float64: Float64Array, int32: Int32Array, int64: BigInt64Array,
                int16: Int16Array, int8: Int8Array, uint8: Uint8Array, uint16: Uint16Array, bool: Uint8Array};

function fromBase64(text) {
  const binary = atob(text);
  const bytes = new Uint8Array(binary.length);
  for (let i = 0; i < binary.length; i++) bytes[i] = binary.charCodeAt(i);
  return bytes;
}

function toBase64(bytes) {
  let binary = '';
  for (let i = 0; i < bytes.length; i += 0x8000) binary += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
  return btoa(binary);
}

function tensor(ort, f) {
  const bytes = fromBase64(f.data);
  const Typed = ARRAYS[f.dtype];
  return new ort.Tensor(f.dtype, new Typed(bytes.buffer, 0, bytes.length / Typed.BYTES_PER_ELEMENT), f.dims);
}

export async function runRequests(ort, requests, readModel) {
  const results = [];
  for (const request of requests) {
    try {
      const session = await ort.InferenceSession.create(await readModel(request.model), {logSeverityLevel: 3});
      const feeds = Object.fromEntries(Object.entries(request.feeds).map(([k, f]) => [k, tensor(ort, f)]));
      const out = await session.run(feeds);
      const outputs = {};
      for (const [k, t] of Object.entries(out)) {
        const data = t.data;
        outputs[k] = {dtype: t.type, dims: t.dims, data: toBase64(new Uint8Array(data.buffer, data.byteOffset, data.byteLength))};
      }
      results.push({inputNames: session.inputNames, outputNames: session.outputNames, outputs});
      await session.release();
    } catch (e) {
      results.push({error: String((e && e.message) || e)});
    }
  }
  return results;
}
