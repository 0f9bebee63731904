// The Vercel AI SDK (`ai` + `@ai-sdk/openai`, schemas in `zod`) against forge: generateText, streamText,
// generateObject and a tool call, each through the provider's default model (the Responses API) and its chat
// model (chat completions), embedMany, and an error. Prints one JSON summary (common.mjs).
import { createOpenAI } from "@ai-sdk/openai";
import { embedMany, generateObject, generateText, Output, stepCountIs, streamText, tool } from "ai";
import { z } from "zod";

import { API_KEY, runParts, target } from "./common.mjs";

const { base, model } = target();
const openai = createOpenAI({ baseURL: `${base}/v1`, apiKey: API_KEY });
const MODELS = { responses: openai(model), chat: openai.chat(model) };
const PROMPT = "Say hello to the world in one short sentence.";
const City = z.object({ city: z.string(), population: z.number().int() });

function resultOf(result) {
  return { text: result.text, finish_reason: result.finishReason, usage: result.usage,
           model_id: result.response?.modelId, warnings: (result.warnings ?? []).map((w) => w.type) };
}

async function text(which) {
  return resultOf(await generateText({
    model: MODELS[which], prompt: PROMPT, maxOutputTokens: 24, temperature: 0, maxRetries: 0,
  }));
}

async function stream(which) {
  const errors = [];
  const result = streamText({
    model: MODELS[which], prompt: PROMPT, maxOutputTokens: 24, temperature: 0, maxRetries: 0,
    onError: ({ error }) => errors.push(String(error?.message ?? error)),
  });
  const deltas = [];
  for await (const delta of result.textStream) deltas.push(delta);
  return { text: await result.text, finish_reason: await result.finishReason, usage: await result.usage,
           deltas, errors };
}

async function object(which) {
  const result = await generateObject({
    model: MODELS[which], schema: City, schemaName: "city", maxOutputTokens: 64, temperature: 0, maxRetries: 0,
    prompt: "Name the capital of France and its population as JSON.",
  });
  return { object: result.object, finish_reason: result.finishReason, usage: result.usage };
}

async function outputObject(which) {
  // What the SDK now recommends over generateObject: generateText with an output.
  const result = await generateText({
    model: MODELS[which], output: Output.object({ schema: City }), maxOutputTokens: 64, temperature: 0,
    maxRetries: 0, prompt: "Name the capital of France and its population as JSON.",
  });
  return { object: result.output, text: result.text, finish_reason: result.finishReason, usage: result.usage };
}

const WEATHER_TOOL = (calls) => tool({
  description: "The current weather in a city.",
  inputSchema: z.object({ city: z.string() }),
  execute: async ({ city }) => { calls.push(city); return { city, sky: "sunny" }; },
});

async function tools(which) {
  // Step one is forced to call the tool, which runs here; step two answers from its result.
  const calls = [];
  const result = await generateText({
    model: MODELS[which], prompt: "What is the weather in Paris?", maxOutputTokens: 48, temperature: 0,
    maxRetries: 0, stopWhen: stepCountIs(2),
    tools: { get_weather: WEATHER_TOOL(calls) },
    prepareStep: ({ stepNumber }) => ({
      toolChoice: stepNumber === 0 ? { type: "tool", toolName: "get_weather" } : "none",
    }),
  });
  return {
    steps: result.steps.map((step) => ({
      finish_reason: step.finishReason,
      tool_calls: step.toolCalls.map(({ toolName, input }) => ({ name: toolName, input })),
      tool_results: step.toolResults.map(({ toolName, output }) => ({ name: toolName, output })),
    })),
    executed_with: calls, text: result.text, usage: result.totalUsage,
  };
}

async function streamTools(which) {
  // The same round trip streamed: the tool's input arrives in deltas the SDK puts together.
  const calls = [];
  const parts = [];
  const errors = [];
  const result = streamText({
    model: MODELS[which], prompt: "What is the weather in Paris?", maxOutputTokens: 48, temperature: 0,
    maxRetries: 0, stopWhen: stepCountIs(2), tools: { get_weather: WEATHER_TOOL(calls) },
    prepareStep: ({ stepNumber }) => ({
      toolChoice: stepNumber === 0 ? { type: "tool", toolName: "get_weather" } : "none",
    }),
    onError: ({ error }) => errors.push(String(error?.message ?? error)),
  });
  const inputDeltas = [];
  for await (const part of result.fullStream) {
    if (parts.at(-1) !== part.type) parts.push(part.type);
    if (part.type === "tool-input-delta") inputDeltas.push(part.delta);
  }
  const steps = await result.steps;
  return {
    steps: steps.map((step) => ({
      finish_reason: step.finishReason,
      tool_calls: step.toolCalls.map(({ toolName, input }) => ({ name: toolName, input })),
      tool_results: step.toolResults.map(({ toolName, output }) => ({ name: toolName, output })),
    })),
    executed_with: calls, text: await result.text, input_deltas: inputDeltas, parts, errors,
  };
}

async function embeddings() {
  const { embeddings: vectors, usage } = await embedMany({
    model: openai.embedding(model), values: ["Hello, world.", "The sky is blue."], maxRetries: 0,
  });
  return { dimensions: vectors.map((v) => v.length), usage };
}

async function wrongModel() {
  try {
    await generateText({ model: openai.chat("no-such-model"), prompt: PROMPT, maxOutputTokens: 4, maxRetries: 0 });
    return { thrown: false };
  } catch (err) {
    return { thrown: err.constructor.name, status: err.statusCode, retryable: err.isRetryable, message: err.message };
  }
}

await runParts({
  generate_text: () => text("responses"), generate_text_chat: () => text("chat"),
  stream_text: () => stream("responses"), stream_text_chat: () => stream("chat"),
  generate_object: () => object("responses"), generate_object_chat: () => object("chat"),
  output_object: () => outputObject("responses"), output_object_chat: () => outputObject("chat"),
  tools: () => tools("responses"), tools_chat: () => tools("chat"),
  stream_tools: () => streamTools("responses"), stream_tools_chat: () => streamTools("chat"), embeddings,
  wrong_model: wrongModel,
});
