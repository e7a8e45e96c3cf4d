// The official `openai` npm client asking for structured outputs: response_format
// json_schema (n samples) and json_object, and vLLM's guided_choice passed as an extra body
// field, streamed. Prints one JSON object.
//   node openai_structured.mjs BASE_URL API_KEY MODEL SCHEMA_JSON
import OpenAI from "openai";

const [baseURL, apiKey, model, schemaText] = process.argv.slice(2);
const schema = JSON.parse(schemaText);
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 300000 });
const messages = [{ role: "user", content: "Describe a person as JSON." }];
const out = {};

const whole = await client.chat.completions.create({
  model, messages, n: 4, seed: 5, temperature: 1, max_tokens: 200,
  response_format: { type: "json_schema", json_schema: { name: "person", schema, strict: true } },
});
out.contents = whole.choices.map((c) => c.message.content);
out.finish = whole.choices.map((c) => c.finish_reason);
out.guided = whole.choices.map((c) => c.guided ?? null);

const object = await client.chat.completions.create({
  model, messages, temperature: 0, max_tokens: 60, response_format: { type: "json_object" },
});
out.object = object.choices[0].message.content;
out.object_finish = object.choices[0].finish_reason;

const stream = await client.chat.completions.create({
  model, messages, stream: true, max_tokens: 20, seed: 2,
  guided_choice: ["positive", "negative", "neutral"],
});
let text = "", finish = null, guided = null;
for await (const chunk of stream) {
  for (const c of chunk.choices) {
    text += c.delta.content ?? "";
    if (c.finish_reason) finish = c.finish_reason;
    if (c.guided !== undefined) guided = c.guided;
  }
}
out.choice = text;
out.choice_finish = finish;
out.choice_guided = guided;
process.stdout.write(JSON.stringify(out));
