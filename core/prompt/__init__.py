"""From what users pass (text, messages, passages) to token ids and passage spans."""
