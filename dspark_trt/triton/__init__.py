"""Triton Inference Server deployment: a model repository writer and the Python-backend model.

    writer.py        `dspark-trt triton`: REPO/NAME/config.pbtxt + REPO/NAME/1/model.py
    model_config.py  config.pbtxt text, checked against Triton's ModelConfig protobuf
    protocol.py      input/output names and types (TensorRT-LLM's), request -> SamplingParams
    settings.py      the config.pbtxt parameters: what the model runs
    model.py         the Python-backend model (runs inside tritonserver, copied into the repository)
    local_server.py  runs the nvidia-pytriton wheel's tritonserver on a repository (CPU hosts, CI)

Nothing here imports Triton at import time; model.py runs only inside Triton's Python backend.
"""
