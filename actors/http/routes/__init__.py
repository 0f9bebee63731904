"""The routes served beside the gateway's own: the Messages, Responses, embeddings and model-management APIs."""
