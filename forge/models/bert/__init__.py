"""The BERT encoder family: bidirectional sentence-embedding models (all-MiniLM-L6-v2) in numpy."""

from forge.models.bert.bert_model import BertConfig, BertModel

__all__ = ["BertConfig", "BertModel"]
