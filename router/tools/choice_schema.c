/* choice_schema.c - the JSON schema that tool_choice "required" or a named function
 * forces the output into (tools.h: tsr_tools_choice_schema), as vLLM 0.12's
 * _get_json_schema_from_tool builds it.  jansson only: router/openai.c calls it while
 * parsing (and tests/fuzz's http target links it without the parsers). */
#include <stdio.h>
#include <string.h>

#include "router/tools/tools.h"

/* {"properties": {"name": {"type": "string", "enum": [name]}, "parameters": P},
 *  "required": ["name", "parameters"]} for one tool (P: {"type": "object",
 * "properties": {}} when the tool has none), as vLLM's get_tool_schema. */
static json_t *tool_item_schema(json_t *fn) {
        json_t *params = json_object_get(fn, "parameters");
        json_t *props = json_object();
        json_t *p = params && json_is_object(params) && json_object_size(params)
                            ? json_deep_copy(params)
                            : json_pack("{s:s, s:{}}", "type", "object", "properties");
        json_object_del(p, "$defs");   /* hoisted to the top level */
        json_object_set_new(props, "name", json_pack("{s:s, s:[O]}", "type", "string", "enum",
                                                     json_object_get(fn, "name")));
        json_object_set_new(props, "parameters", p);
        return json_pack("{s:o, s:[s, s]}", "properties", props, "required", "name", "parameters");
}

json_t *tsr_tools_choice_schema(json_t *tools, const char *tool_choice, const char *name, char *err, size_t errlen) {
        json_t *t, *any, *defs, *schema;
        size_t i;

        if (!tool_choice || !tools)
                return NULL;
        if (strcmp(tool_choice, "function") == 0) {
                json_array_foreach(tools, i, t) {
                        json_t *fn = json_object_get(t, "function"), *params = json_object_get(fn, "parameters");
                        if (strcmp(json_string_value(json_object_get(fn, "name")), name) != 0)
                                continue;
                        /* vLLM returns tool.parameters itself: {} is a schema (any JSON
                         * value), a missing one leaves the output free */
                        return json_is_object(params) ? json_incref(params) : json_null();
                }
                return NULL;
        }
        if (strcmp(tool_choice, "required") != 0)
                return NULL;
        any = json_array();
        defs = json_object();
        json_array_foreach(tools, i, t) {
                json_t *fn = json_object_get(t, "function");
                json_t *d = json_object_get(json_object_get(fn, "parameters"), "$defs");
                const char *k;
                json_t *v;
                json_object_foreach(d, k, v) {
                        json_t *had = json_object_get(defs, k);
                        if (had && !json_equal(had, v)) {
                                snprintf(err, errlen, "Tool definition '%s' has multiple schemas, which is not supported.",
                                         k);
                                json_decref(any);
                                json_decref(defs);
                                return NULL;
                        }
                        json_object_set(defs, k, v);
                }
                json_array_append_new(any, tool_item_schema(fn));
        }
        schema = json_pack("{s:s, s:i, s:{s:s, s:o}}", "type", "array", "minItems", 1, "items", "type", "object",
                           "anyOf", any);
        if (schema && json_object_size(defs))
                json_object_set(schema, "$defs", defs);
        json_decref(defs);
        return schema;
}
