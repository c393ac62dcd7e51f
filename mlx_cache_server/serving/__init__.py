"""One class per API surface, turning a validated request into engine calls and back.

Routes delegate here (as vLLM's entrypoints/openai/serving_*.py do); what the
surfaces share is in `limits` (checks and the capacity slot), `generation`
(running one generation for a handler) and `sse` (streaming).
"""
