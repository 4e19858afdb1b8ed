"""Old import path of the model functions, kept so existing imports keep working; use `earl_stream.model`."""

from earl_stream.model.default import DEFAULT_MODEL_NAME, default_model_dir, ensure_default_model
from earl_stream.model.loading import count_parameters, load_model, load_tokenizer
from earl_stream.model.tiny import CHAT_TEMPLATE, SPECIAL_TOKENS, _train_tokenizer, init_model

__all__ = [
    "CHAT_TEMPLATE",
    "DEFAULT_MODEL_NAME",
    "SPECIAL_TOKENS",
    "_train_tokenizer",
    "count_parameters",
    "default_model_dir",
    "ensure_default_model",
    "init_model",
    "load_model",
    "load_tokenizer",
]
