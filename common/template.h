/* template.h - the Jinja2 subset that renders Hugging Face chat templates.
 *
 * Renders byte-exact what Python jinja2 renders in the environment transformers builds
 * for apply_chat_template: ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks
 * and the loopcontrols extension; the globals raise_exception, strftime_now, namespace,
 * dict and range; a tojson filter that is json.dumps(ensure_ascii=False, ...).  The
 * language covered, and what is left out, is listed at the top of
 * template/template_int.h (the engine's files are in common/template/).
 *
 * A parsed tsr_template is immutable: any number of threads may render it at once.
 * Rendering allocates only per call (an arena freed before return), so the bounds in
 * tsr_template_opts hold per render, whatever the template or the context does.
 * Non-logging: failures come back as a status and a message. */
#ifndef TSR_TEMPLATE_H
#define TSR_TEMPLATE_H

#include <stddef.h>
#include <stdint.h>
#include <time.h>
#include <jansson.h>
#include "tsr_status.h"

typedef struct tsr_template tsr_template;

/* strftime_now(format): write the formatted current time into out (outlen bytes, NUL
 * terminated) and return its length, or 0 on failure (an empty string is rendered).
 * Called on the rendering thread.  NULL in the options means the local time now. */
typedef size_t (*tsr_template_strftime_fn)(char *out, size_t outlen, const char *format, void *user);

typedef struct tsr_template_opts {
        size_t max_output;              /* bytes of rendered text; 0 = 64 MiB */
        size_t max_memory;              /* bytes of render-time allocations; 0 = 256 MiB */
        uint64_t max_steps;             /* evaluation steps (nodes, iterations, elements); 0 = 50 million */
        uint32_t max_depth;             /* nested macro calls; 0 = 64 */
        tsr_template_strftime_fn strftime_now;  /* NULL = local time via strftime(3) */
        void *strftime_user;
} tsr_template_opts;

/* Parse `len` bytes of template source (UTF-8, need not be NUL-terminated).  On success
 * *ret is a new template the caller frees with tsr_template_free; it keeps no pointer
 * into `src`.  Returns TSR_E_INVAL for a syntax error, with "line L, column C: ..." in
 * `err` (if not NULL), TSR_E_UNSUPPORTED for valid Jinja outside the subset (a recursive
 * loop, `set` of a dotted name as a block), TSR_E_LIMIT when the source nests too deep,
 * TSR_E_NOMEM. */
tsr_status tsr_template_parse(const char *src, size_t len, tsr_template **ret, char *err, size_t errlen);

/* Render `t` with the variables of the JSON object `context` (messages, tools,
 * add_generation_prompt, bos_token, eos_token, chat_template_kwargs merged at the top
 * level).  `context` is borrowed and must not change during the call.  opts may be NULL.
 * On success *out is a new NUL-terminated string (free() it) of *out_len bytes.
 * Returns TSR_E_INVAL for raise_exception (err holds its message, exactly) or a runtime
 * error such as a type error or an attribute of an undefined value (err says which);
 * TSR_E_UNSUPPORTED for a Python method, format spec or conversion outside the subset;
 * TSR_E_LIMIT when output, memory, steps or depth pass their bound; TSR_E_NOMEM.
 * Outputs are written only on success.  Thread-safe for a shared `t`. */
tsr_status tsr_template_render(const tsr_template *t, const json_t *context, const tsr_template_opts *opts,
                               char **out, size_t *out_len, char *err, size_t errlen);

/* Accepts NULL and *t == NULL; clears *t. */
void tsr_template_free(tsr_template **t);

#endif
