"""The data's description, read alike by the coordinator, the clients and the stage
servers: how data.source names its token files and their weights, the tokenizers that
give ids their meaning, and the check that a model's vocabulary holds its data's."""
