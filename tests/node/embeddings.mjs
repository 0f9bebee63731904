// Embeddings through the `openai` SDK (base64, its default, and floats cut to 128 dimensions) and the Vercel AI
// SDK (embedMany, embed), for an embedding model served beside a generation model. Run as
// `node embeddings.mjs BASE_URL MODEL TEXT...`; prints one JSON summary (common.mjs).
import { createOpenAI } from "@ai-sdk/openai";
import { embed, embedMany } from "ai";
import OpenAI from "openai";

import { API_KEY, runParts, target } from "./common.mjs";

const { base, model } = target();
const texts = process.argv.slice(4);
const client = new OpenAI({ baseURL: `${base}/v1`, apiKey: API_KEY, maxRetries: 0 });
const provider = createOpenAI({ baseURL: `${base}/v1`, apiKey: API_KEY });

function listOf(reply) {
  return { object: reply.object, model: reply.model, indexes: reply.data.map((item) => item.index),
           vectors: reply.data.map((item) => item.embedding), usage: reply.usage };
}

await runParts({
  openai: async () => listOf(await client.embeddings.create({ model, input: texts })),
  openai_floats: async () => listOf(await client.embeddings.create({
    model, input: texts, encoding_format: "float", dimensions: 128,
  })),
  embed_many: async () => {
    const { embeddings, usage } = await embedMany({ model: provider.embedding(model), values: texts, maxRetries: 0 });
    return { vectors: embeddings, usage };
  },
  embed: async () => {
    const { embedding, usage } = await embed({ model: provider.embedding(model), value: texts[0], maxRetries: 0 });
    return { vector: embedding, usage };
  },
});
