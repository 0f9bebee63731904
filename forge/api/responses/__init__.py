"""OpenAI's Responses API: its schema and the chat request it means, its output, the store."""
