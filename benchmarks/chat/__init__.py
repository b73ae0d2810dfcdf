"""bench chat: multi-turn chat, exact prefix reuse per turn against full prefill."""
