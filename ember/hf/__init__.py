"""The Hugging Face format: safetensors files, the Llama / Mixtral tensor layout, tokenizer files, and
parameters loaded from such a directory straight onto the mesh. Export and sampling front ends are
ember/tools/export_hf.py and ember/tools/sample.py."""
