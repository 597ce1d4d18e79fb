/* runner.h - the model runner the engine drives: a loaded model plus the KV pool its
 * paged attention reads, behind engine.h's engine_model interface.
 *
 * Built by the worker's main thread before the engine starts, then used only by the
 * engine thread.  Today: Llama-architecture GGUF files on the CPU reference kernels. */
#ifndef TSR_WORKER_RUNNER_H
#define TSR_WORKER_RUNNER_H

#include <stddef.h>
#include <stdint.h>

#include "engine.h"
#include "weights.h"

typedef struct tsr_runner tsr_runner;

/* Load `path` and allocate a KV pool of `num_blocks` blocks of `block_size` tokens.
 * TSR_E_UNSUPPORTED when the file is not a model this runner knows (the caller then
 * serves metadata only), other statuses with the file and tensor named in err. */
tsr_status tsr_runner_new(const char *path, uint64_t num_blocks, uint32_t block_size, tsr_runner **ret,
                          tsr_load_stats *stats, char *err, size_t errlen);
void tsr_runner_free(tsr_runner **r);
/* The engine's view of the runner; valid while the runner lives. */
const engine_model *tsr_runner_model(const tsr_runner *r);

#endif
