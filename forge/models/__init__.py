"""The models: reading GGUF files, the Llama families and the BERT encoder, loading a served model, the catalogue
of models fetched by name."""
