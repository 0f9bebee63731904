// The `openai` Node SDK against forge: chat (plain, streamed, tools, json_schema, zod parse), completions,
// the Responses API (plain, streamed, tools, zod parse), embeddings, the model list and an error. Prints one
// JSON summary (common.mjs).
import OpenAI from "openai";
import { zodResponseFormat, zodTextFormat } from "openai/helpers/zod";
import { z } from "zod";

import { API_KEY, runParts, target } from "./common.mjs";

const { base, model } = target();
const client = new OpenAI({ baseURL: `${base}/v1`, apiKey: API_KEY, maxRetries: 0 });

const ASK = [{ role: "user", content: "Say hello to the world in one short sentence." }];
const WEATHER = {
  type: "function",
  function: {
    name: "get_weather",
    description: "The current weather in a city.",
    parameters: {
      type: "object",
      properties: { city: { type: "string" } },
      required: ["city"],
      additionalProperties: false,
    },
    strict: true,
  },
};
const WEATHER_ASK = [{ role: "user", content: "What is the weather in Paris?" }];
export const CITY_SCHEMA = {
  type: "object",
  properties: { city: { type: "string" }, population: { type: "integer" } },
  required: ["city", "population"],
  additionalProperties: false,
};
const City = z.object({ city: z.string(), population: z.number().int() });
const CITY_ASK = [{ role: "user", content: "Name the capital of France and its population as JSON." }];

function choiceOf(completion) {
  const [choice] = completion.choices;
  return {
    id: completion.id, object: completion.object, model: completion.model, n_choices: completion.choices.length,
    text: choice.message.content, role: choice.message.role, finish_reason: choice.finish_reason,
    tool_calls: (choice.message.tool_calls ?? []).map((c) => ({ id: c.id, type: c.type, ...c.function })),
    usage: completion.usage,
  };
}

async function chat() {
  return choiceOf(await client.chat.completions.create({ model, messages: ASK, max_tokens: 24, temperature: 0 }));
}

async function chatStream() {
  // The SDK's stream helper: its accumulator refuses chunks that do not fit together.
  const stream = client.chat.completions.stream({
    model, messages: ASK, max_tokens: 24, temperature: 0, stream_options: { include_usage: true },
  });
  const deltas = [];
  const ids = new Set();
  let chunks = 0;
  stream.on("chunk", (chunk) => { chunks += 1; ids.add(chunk.id); });
  stream.on("content.delta", ({ delta }) => deltas.push(delta));
  const final = await stream.finalChatCompletion();
  return { ...choiceOf(final), deltas, chunks, chunk_ids: [...ids] };
}

async function completion() {
  const reply = await client.completions.create({
    model, prompt: "The capital of France is", max_tokens: 8, temperature: 0,
  });
  return { object: reply.object, text: reply.choices[0].text, finish_reason: reply.choices[0].finish_reason,
           usage: reply.usage };
}

async function completionStream() {
  const stream = await client.completions.create({
    model, prompt: "The capital of France is", max_tokens: 8, temperature: 0, stream: true,
    stream_options: { include_usage: true },
  });
  const deltas = [];
  let finish_reason = null;
  let usage = null;
  for await (const chunk of stream) {
    for (const choice of chunk.choices) {
      deltas.push(choice.text);
      finish_reason = choice.finish_reason ?? finish_reason;
    }
    usage = chunk.usage ?? usage;
  }
  return { deltas, finish_reason, usage };
}

function responseOf(response) {
  return {
    id: response.id, object: response.object, status: response.status, model: response.model,
    text: response.output_text, output_types: response.output.map((item) => item.type),
    function_calls: response.output.filter((item) => item.type === "function_call")
      .map(({ call_id, name, arguments: args }) => ({ call_id, name, arguments: args })),
    usage: response.usage,
  };
}

async function responses() {
  return responseOf(await client.responses.create({
    model, input: "Say hello to the world in one short sentence.", max_output_tokens: 24, temperature: 0,
  }));
}

async function responsesStream() {
  const stream = client.responses.stream({
    model, input: "Say hello to the world in one short sentence.", max_output_tokens: 24, temperature: 0,
  });
  const deltas = [];
  const events = [];
  let done_text = null;
  for await (const event of stream) {
    if (events.at(-1) !== event.type) events.push(event.type);
    if (event.type === "response.output_text.delta") deltas.push(event.delta);
    if (event.type === "response.output_text.done") done_text = event.text;
  }
  return { ...responseOf(await stream.finalResponse()), deltas, events, done_text };
}

async function chatTools() {
  // A forced call, then its result sent back for the answer: the round trip an agent loop makes.
  const first = await client.chat.completions.create({
    model, messages: WEATHER_ASK, tools: [WEATHER], max_tokens: 48, temperature: 0,
    tool_choice: { type: "function", function: { name: "get_weather" } },
  });
  const call = first.choices[0].message.tool_calls?.[0];
  const messages = [...WEATHER_ASK, first.choices[0].message];
  if (call) messages.push({ role: "tool", tool_call_id: call.id, content: JSON.stringify({ sky: "sunny", c: 21 }) });
  const second = await client.chat.completions.create({
    model, messages, tools: [WEATHER], tool_choice: "none", max_tokens: 24, temperature: 0,
  });
  return { call: choiceOf(first), answer: choiceOf(second) };
}

async function chatToolsStream() {
  const stream = client.chat.completions.stream({
    model, messages: WEATHER_ASK, tools: [WEATHER], max_tokens: 48, temperature: 0,
    tool_choice: { type: "function", function: { name: "get_weather" } },
  });
  const argument_deltas = [];
  const done = [];
  stream.on("tool_calls.function.arguments.delta", ({ arguments_delta }) => argument_deltas.push(arguments_delta));
  stream.on("tool_calls.function.arguments.done", ({ name, arguments: args }) => done.push({ name, arguments: args }));
  return { ...choiceOf(await stream.finalChatCompletion()), argument_deltas, done };
}

async function responsesTools() {
  const tool = { type: "function", ...WEATHER.function };
  const first = await client.responses.create({
    model, input: "What is the weather in Paris?", tools: [tool], max_output_tokens: 48, temperature: 0,
    tool_choice: { type: "function", name: "get_weather" },
  });
  const call = first.output.find((item) => item.type === "function_call");
  const input = [{ role: "user", content: "What is the weather in Paris?" }, ...first.output];
  if (call) input.push({ type: "function_call_output", call_id: call.call_id, output: '{"sky": "sunny"}' });
  const second = await client.responses.create({
    model, input, tools: [tool], tool_choice: "none", max_output_tokens: 24, temperature: 0,
  });
  return { call: responseOf(first), answer: responseOf(second) };
}

async function chatJsonSchema() {
  const reply = await client.chat.completions.create({
    model, messages: CITY_ASK, max_tokens: 64, temperature: 0,
    response_format: { type: "json_schema", json_schema: { name: "city", schema: CITY_SCHEMA, strict: true } },
  });
  return choiceOf(reply);
}

async function chatParse() {
  const reply = await client.chat.completions.parse({
    model, messages: CITY_ASK, max_tokens: 64, temperature: 0, response_format: zodResponseFormat(City, "city"),
  });
  return { ...choiceOf(reply), parsed: reply.choices[0].message.parsed };
}

async function responsesParse() {
  const reply = await client.responses.parse({
    model, input: CITY_ASK, max_output_tokens: 64, temperature: 0, text: { format: zodTextFormat(City, "city") },
  });
  return { ...responseOf(reply), parsed: reply.output_parsed };
}

async function embeddings() {
  // The SDK asks for base64 unless told otherwise, and decodes it.
  const reply = await client.embeddings.create({ model, input: ["Hello, world.", "The sky is blue."] });
  const floats = await client.embeddings.create({ model, input: "Hello, world.", encoding_format: "float" });
  return {
    object: reply.object, model: reply.model, indexes: reply.data.map((item) => item.index),
    dimensions: reply.data.map((item) => item.embedding.length), usage: reply.usage,
    first: reply.data[0].embedding, first_as_floats: floats.data[0].embedding,
  };
}

async function models() {
  const listed = await client.models.list();
  const one = await client.models.retrieve(model);
  return { ids: listed.data.map((m) => m.id), retrieved: one.id };
}

async function wrongModel() {
  // forge's error envelope, read by the SDK into its error class and fields.
  try {
    await client.chat.completions.create({ model: "no-such-model", messages: ASK, max_tokens: 4 });
    return { thrown: false };
  } catch (err) {
    return { thrown: err.constructor.name, status: err.status, code: err.code, param: err.param, type: err.type };
  }
}

await runParts({
  chat, chat_stream: chatStream, completion, completion_stream: completionStream, responses,
  responses_stream: responsesStream, chat_tools: chatTools, chat_tools_stream: chatToolsStream,
  responses_tools: responsesTools, chat_json_schema: chatJsonSchema, chat_parse: chatParse,
  responses_parse: responsesParse, embeddings, models, wrong_model: wrongModel,
});
