"""Group samplers that encode each prompt once and share its KV cache across the group."""
