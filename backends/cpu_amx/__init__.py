"""The cpu_amx backend: Intel CPUs with AMX (Sapphire Rapids and later); bf16 products on AMX tiles."""
