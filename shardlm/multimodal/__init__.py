"""Images in prompts, for vision-language checkpoints (LLaVA's family), as vLLM takes them.

    front end   processing.py: the checkpoint's Hugging Face processor turns a text prompt and its
                images into token ids (each image's placeholder token repeated as many times as
                the image has embeddings) and one MultiModalItem per image (its placeholder
                positions, a content hash, its pixel tensors); media.py reads images from
                image_url parts (data:, http(s):, file: under --allowed-local-media-path)
    engine core the items ride with the request; prefix-cache keys of blocks holding an image's
                placeholders include its hash (core/request.py)
    workers     vision_encoder.py: the checkpoint's vision tower and projector (transformers'
                own modules) on the first pipeline stage compute an image's embeddings the first
                time one of its placeholders is scheduled; embeddings.py hands them to the text
                model, which puts them in place of the placeholders' token embeddings
"""
