"""GPTQ: checkpoint config, int4/int8 packing, the GPTQ linear layer, and (with the quantize extra) the solver driver.

Importing this package loads nothing heavy; GPTQModel is imported only by `infer.quant.quantize`.
"""
