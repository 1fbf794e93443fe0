"""Built-in strategies of omni-accum, one module each; each module is a plugin of group ``omni_accum``."""
