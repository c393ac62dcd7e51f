"""mlx-cache-server: the HTTP layer (routes, schemas, engine) over `prompt_cache`."""
