// The `@anthropic-ai/sdk` Node SDK against forge's Messages API: create, stream, countTokens, a forced tool
// call sent back as a tool_result, structured outputs (messages.parse with a zod schema), the model list and
// an error. Prints one JSON summary (common.mjs).
import Anthropic from "@anthropic-ai/sdk";
import { zodOutputFormat } from "@anthropic-ai/sdk/helpers/zod";
import { z } from "zod";

import { API_KEY, runParts, target } from "./common.mjs";

const { base, model } = target();
const client = new Anthropic({ baseURL: base, apiKey: API_KEY, maxRetries: 0 });

const SYSTEM = "You are a friendly assistant.";
const ASK = [{ role: "user", content: "Say hello to the world in one short sentence." }];
const WEATHER = {
  name: "get_weather",
  description: "The current weather in a city.",
  input_schema: { type: "object", properties: { city: { type: "string" } }, required: ["city"] },
};
const WEATHER_ASK = [{ role: "user", content: "What is the weather in Paris?" }];
const City = z.object({ city: z.string(), population: z.number().int() });
const CITY_ASK = [{ role: "user", content: "Name the capital of France and its population as JSON." }];

function messageOf(message) {
  return {
    id: message.id, type: message.type, role: message.role, model: message.model,
    block_types: message.content.map((block) => block.type),
    text: message.content.filter((block) => block.type === "text").map((block) => block.text).join(""),
    tool_uses: message.content.filter((block) => block.type === "tool_use")
      .map(({ id, name, input }) => ({ id, name, input })),
    stop_reason: message.stop_reason, usage: message.usage,
  };
}

async function create() {
  return messageOf(await client.messages.create({
    model, system: SYSTEM, messages: ASK, max_tokens: 24, temperature: 0,
  }));
}

async function stream() {
  const stream = client.messages.stream({ model, system: SYSTEM, messages: ASK, max_tokens: 24, temperature: 0 });
  const deltas = [];
  const events = [];
  stream.on("text", (delta) => deltas.push(delta));
  stream.on("streamEvent", (event) => { if (events.at(-1) !== event.type) events.push(event.type); });
  return { ...messageOf(await stream.finalMessage()), deltas, events };
}

async function countTokens() {
  const counted = await client.messages.countTokens({ model, system: SYSTEM, messages: ASK });
  const withTools = await client.messages.countTokens({ model, system: SYSTEM, messages: ASK, tools: [WEATHER] });
  return { input_tokens: counted.input_tokens, with_tools: withTools.input_tokens };
}

async function tools() {
  const first = await client.messages.create({
    model, messages: WEATHER_ASK, tools: [WEATHER], tool_choice: { type: "tool", name: "get_weather" },
    max_tokens: 48, temperature: 0,
  });
  const use = first.content.find((block) => block.type === "tool_use");
  const messages = [...WEATHER_ASK, { role: "assistant", content: first.content }];
  if (use) {
    messages.push({ role: "user", content: [{ type: "tool_result", tool_use_id: use.id, content: "Sunny, 21 C." }] });
  }
  const second = await client.messages.create({
    model, messages, tools: [WEATHER], tool_choice: { type: "none" }, max_tokens: 24, temperature: 0,
  });
  return { call: messageOf(first), answer: messageOf(second) };
}

async function toolsStream() {
  const stream = client.messages.stream({
    model, messages: WEATHER_ASK, tools: [WEATHER], tool_choice: { type: "tool", name: "get_weather" },
    max_tokens: 48, temperature: 0,
  });
  const json_deltas = [];
  stream.on("inputJson", (delta) => json_deltas.push(delta));
  return { ...messageOf(await stream.finalMessage()), json_deltas };
}

async function parse() {
  // Structured outputs: output_config.format from a zod schema, the reply parsed and checked by the SDK.
  const message = await client.messages.parse({
    model, messages: CITY_ASK, max_tokens: 64, temperature: 0, output_config: { format: zodOutputFormat(City) },
  });
  return { ...messageOf(message), parsed: message.parsed_output };
}

async function parseStream() {
  const stream = client.messages.stream({
    model, messages: CITY_ASK, max_tokens: 64, temperature: 0, output_config: { format: zodOutputFormat(City) },
  });
  const message = await stream.finalMessage();
  return { ...messageOf(message), parsed: message.parsed_output };
}

async function models() {
  return { ids: (await client.models.list()).data.map((m) => m.id) };
}

async function wrongModel() {
  try {
    await client.messages.create({ model: "no-such-model", messages: ASK, max_tokens: 4 });
    return { thrown: false };
  } catch (err) {
    return { thrown: err.constructor.name, status: err.status, type: err.error?.error?.type };
  }
}

await runParts({
  create, stream, count_tokens: countTokens, tools, tools_stream: toolsStream, parse, parse_stream: parseStream,
  models, wrong_model: wrongModel,
});
