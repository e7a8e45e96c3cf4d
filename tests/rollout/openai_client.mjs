// Drives a flywheel worker's OpenAI-compatible routes with the official `openai` npm client:
// models, completions (with top logprobs), chat (with tools and top logprobs), and both
// streamed. Prints one JSON object of what it saw (counts, and the values: token ids and
// logprobs); the C++ test checks it against the engine's own output for the same requests.
//   node openai_client.mjs BASE_URL API_KEY MODEL
import OpenAI from "openai";

const [baseURL, apiKey, model] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 60000 });
const out = {};

const models = await client.models.list();
out.models = models.data.map((m) => m.id);

const completion = await client.completions.create({
  model, prompt: "The capital of France is", max_tokens: 8, seed: 3, logprobs: 3,
});
out.completion_text = completion.choices[0].text;
out.completion_tokens = completion.usage.completion_tokens;
out.completion_top = completion.choices[0].logprobs.top_logprobs.map((t) => Object.keys(t).length);
out.completion_finish = completion.choices[0].finish_reason;
out.completion_prompt_tokens = completion.usage.prompt_tokens;
out.completion_token_logprobs = completion.choices[0].logprobs.token_logprobs;
out.completion_top_values = completion.choices[0].logprobs.top_logprobs.map((t) => Object.values(t));

const messages = [
  { role: "system", content: "You are terse." },
  { role: "user", content: "Say hi in French." },
];
const chat = await client.chat.completions.create({
  model, messages, max_tokens: 10, seed: 4, logprobs: true, top_logprobs: 2,
});
out.chat_content = chat.choices[0].message.content;
out.chat_finish = chat.choices[0].finish_reason;
out.chat_logprobs = chat.choices[0].logprobs.content.map((c) => c.top_logprobs.length);
out.chat_token_ids = chat.choices[0].token_ids;  // flywheel's own field rides along
out.chat_logprob_values = chat.choices[0].logprobs.content.map((c) => c.logprob);
out.chat_top_values = chat.choices[0].logprobs.content.map((c) => c.top_logprobs.map((t) => t.logprob));

const stream = await client.chat.completions.create({
  model, messages, max_tokens: 10, seed: 4, stream: true, stream_options: { include_usage: true },
});
let streamed = "", chunks = 0, usage = null, finish = null;
for await (const chunk of stream) {
  chunks += 1;
  if (chunk.usage) usage = chunk.usage;
  for (const c of chunk.choices) {
    streamed += c.delta.content ?? "";
    if (c.finish_reason) finish = c.finish_reason;
  }
}
out.stream_content = streamed;
out.stream_chunks = chunks;
out.stream_usage = usage;
out.stream_finish = finish;

const cstream = await client.completions.create({
  model, prompt: "The capital of France is", max_tokens: 8, seed: 3, stream: true,
});
let ctext = "";
for await (const chunk of cstream) ctext += chunk.choices[0]?.text ?? "";
out.completion_stream_text = ctext;

const tools = [{
  type: "function",
  function: {
    name: "get_weather",
    description: "Weather in a city",
    parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] },
  },
}];
const withTools = await client.chat.completions.create({
  model, messages: [{ role: "user", content: "Weather in Paris?" }], tools, max_tokens: 6, seed: 5,
});
out.tools_prompt_tokens = withTools.usage.prompt_tokens;
out.plain_prompt_tokens = chat.usage.prompt_tokens;

try {
  await new OpenAI({ baseURL, apiKey: "wrong", maxRetries: 0 }).models.list();
  out.wrong_key = "accepted";
} catch (e) {
  out.wrong_key = e.status;
}
process.stdout.write(JSON.stringify(out));
