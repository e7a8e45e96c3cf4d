// The reference for tokenizer parity: @huggingface/tokenizers (the JS port of HF's
// tokenizers). Reads {"tokenizer": path, "config": path or "", "texts": [...],
// "decode": [[ids]...], "bench": path or ""} from the file named by argv[2] and prints
// {"ids", "prompt_ids", "decoded", "decoded_special", "bench_mb_per_s", "bench_tokens"}.
import { Tokenizer } from "@huggingface/tokenizers";
import fs from "fs";

const request = JSON.parse(fs.readFileSync(process.argv[2], "utf8"));
const json = JSON.parse(fs.readFileSync(request.tokenizer, "utf8"));
const config = request.config ? JSON.parse(fs.readFileSync(request.config, "utf8")) : {};
const tok = new Tokenizer(json, config);
const out = { ids: [], prompt_ids: [], decoded: [], decoded_special: [] };
for (const text of request.texts) {
  out.ids.push(Array.from(tok.encode(text, { add_special_tokens: false }).ids));
  out.prompt_ids.push(Array.from(tok.encode(text, { add_special_tokens: true }).ids));
}
for (const ids of request.decode ?? []) {
  // (The JS port refuses an empty list; the empty text is the answer.)
  const decode = (skip) =>
    ids.length === 0 ? "" : tok.decode(ids, { skip_special_tokens: skip, clean_up_tokenization_spaces: false });
  out.decoded.push(decode(true));
  out.decoded_special.push(decode(false));
}
if (request.bench) {
  const text = fs.readFileSync(request.bench, "utf8");
  const bytes = Buffer.byteLength(text, "utf8");
  tok.encode(text.slice(0, 100000), { add_special_tokens: false });  // warm up
  const t0 = performance.now();
  const ids = tok.encode(text, { add_special_tokens: false }).ids;
  const t1 = performance.now();
  out.bench_mb_per_s = bytes / 1e6 / ((t1 - t0) / 1000);
  out.bench_tokens = ids.length;
  out.bench_ids = Array.from(ids);
}
process.stdout.write(JSON.stringify(out));
