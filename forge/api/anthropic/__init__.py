"""Anthropic's Messages API: its schema and the chat request it means, its output."""
