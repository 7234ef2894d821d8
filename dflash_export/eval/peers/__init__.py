"""Side-by-side measurements against peer runtimes (onnxruntime-genai, llama.cpp), each in its own worker."""
