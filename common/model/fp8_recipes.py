"""train.fp8_recipe's values: torchao's float8 training recipes of those names
(stageserver/model/fp8.py), one float8 scale per tensor or per row of each operand."""

FP8_RECIPES = ("tensorwise", "rowwise")
