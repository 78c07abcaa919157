"""The data's description, read alike by the coordinator, the clients and the stage
servers: how data.source names its token files and their weights."""
