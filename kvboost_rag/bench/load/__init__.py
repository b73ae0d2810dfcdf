"""bench load: concurrent requests, batched vs serialized vs HuggingFacePipeline."""
