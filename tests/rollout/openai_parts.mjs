// The official `openai` npm client reading a chat answer with reasoning and tool calls, whole
// and streamed (deltas accumulated as OpenAI's docs show: content, reasoning_content, and
// tool_calls by index with their argument fragments). Prints one JSON object.
//   node openai_parts.mjs BASE_URL API_KEY MODEL
import OpenAI from "openai";

const [baseURL, apiKey, model] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 60000 });
const request = {
  model,
  messages: [{ role: "user", content: "w?" }],
  tools: [{ type: "function", function: { name: "w", parameters: { type: "object" } } }],
  temperature: 0,
  stop: ["<|im_end|>"],
  max_tokens: 200,
};
const out = {};
const whole = await client.chat.completions.create(request);
const message = whole.choices[0].message;
out.content = message.content;
out.reasoning = message.reasoning_content ?? null;
out.calls = (message.tool_calls ?? []).map((c) => [c.function.name, c.function.arguments, c.type]);
out.finish = whole.choices[0].finish_reason;

const stream = await client.chat.completions.create({ ...request, stream: true });
let content = "", reasoning = "", finish = null;
const calls = [];
for await (const chunk of stream) {
  for (const c of chunk.choices) {
    content += c.delta.content ?? "";
    reasoning += c.delta.reasoning_content ?? "";
    for (const t of c.delta.tool_calls ?? []) {
      if (!calls[t.index]) calls[t.index] = { name: "", arguments: "", id: t.id };
      calls[t.index].name += t.function?.name ?? "";
      calls[t.index].arguments += t.function?.arguments ?? "";
    }
    if (c.finish_reason) finish = c.finish_reason;
  }
}
out.stream_content = content;
out.stream_reasoning = reasoning;
out.stream_calls = calls.map((c) => [c.name, c.arguments, c.id.startsWith("call_")]);
out.stream_finish = finish;
process.stdout.write(JSON.stringify(out));
