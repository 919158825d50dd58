"""agentjet-server[tinker] alone: the Tinker SDK (which the extra installs) creates a LoRA training client
on the embedded model, and two cross-entropy steps lower its loss."""

import tinker
from _smoke import Server
from tinker import types

with Server() as server:
    service = tinker.ServiceClient(base_url=server.url, api_key="tml-smoke")
    training = service.create_lora_training_client(base_model="agentjet-tiny", rank=8).result()
    tokens = training.get_tokenizer().encode("the answer is seven")
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    losses = []
    for _ in range(3):
        losses.append(training.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"])
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert losses[2] < losses[0], losses
print(f"tinker: a LoRA training client's loss went {losses[0]:.2f} -> {losses[2]:.2f} in two steps")
