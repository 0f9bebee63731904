"""Text: the tokenizer a GGUF file describes, incremental detokenizing, stop strings, chat templates, the tool-
call format."""
