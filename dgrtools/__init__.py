"""dgr's tooling, apart from the service: the demo, a private redis-server, a consumer subprocess, the
evidence document, the model builders (tiny, Gemma) and a tokenizer. `dgr consumer` loads none of it
unless asked for a model by name ('tiny', 'gemma')."""
