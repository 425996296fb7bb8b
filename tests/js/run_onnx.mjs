// Runs ONNX models in ONNX Runtime's JavaScript packages under Node.js (see client.mjs for the files).
//   node run_onnx.mjs web|node REQUESTS.json RESULTS.json
// "web" is onnxruntime-web on its WebAssembly backend (the build browsers run); "node" is onnxruntime-node.
import fs from 'node:fs';
import {runRequests} from './client.mjs';

const [which, requestsPath, resultsPath] = process.argv.slice(2);
const ort = await import(which === 'web' ? 'onnxruntime-web' : 'onnxruntime-node');
if (which === 'web') ort.env.wasm.numThreads = 1;
const requests = JSON.parse(fs.readFileSync(requestsPath, 'utf8'));
fs.writeFileSync(resultsPath, JSON.stringify(await runRequests(ort, requests, (path) => fs.readFileSync(path))));
