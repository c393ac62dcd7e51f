"""The seam to mlx-lm and MLX: every reach into their private names or change to their objects."""
