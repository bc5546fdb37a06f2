/* C shim: the parts of the ucp API that are macros or static inline functions, made callable from Rust. */
#ifndef KVX_UCX_SHIM_H
#define KVX_UCX_SHIM_H

#include <stdint.h>
#include <ucp/api/ucp.h>
/* For ucs_global_opts_set_value: process-wide UCX options (such as MODULES) set before the first
   ucp_init, for processes whose environment the library cannot choose. */
#include <ucs/config/global_opts.h>

/* ucp_init (static inline): binds the API version of the headers we were built with. */
ucs_status_t kvx_ucp_init(const ucp_params_t *params, const ucp_config_t *config, ucp_context_h *context_p);

/* UCS_PTR_IS_ERR: the pointer encodes an error status. */
int kvx_ucs_ptr_is_err(const void *ptr);

/* UCS_PTR_IS_PTR: the pointer is a real request handle (not NULL, not an error). */
int kvx_ucs_ptr_is_ptr(const void *ptr);

/* UCS_PTR_STATUS: UCS_INPROGRESS for a request handle, otherwise the encoded status (UCS_OK for NULL). */
ucs_status_t kvx_ucs_ptr_status(const void *ptr);

/* UCS_PTR_RAW_STATUS: the status encoded in the pointer, without the request-handle check. */
ucs_status_t kvx_ucs_ptr_raw_status(const void *ptr);

/* UCP_API_MAJOR and UCP_API_MINOR: the API version of the headers this crate was built against. */
void kvx_ucp_api_version(unsigned *major, unsigned *minor);

#endif
