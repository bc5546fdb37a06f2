#include "shim.h"

/* ucp_init */
ucs_status_t kvx_ucp_init(const ucp_params_t *params, const ucp_config_t *config, ucp_context_h *context_p)
{
    return ucp_init(params, config, context_p);
}

/* UCS_PTR_IS_ERR */
int kvx_ucs_ptr_is_err(const void *ptr)
{
    return UCS_PTR_IS_ERR(ptr);
}

/* UCS_PTR_IS_PTR */
int kvx_ucs_ptr_is_ptr(const void *ptr)
{
    return UCS_PTR_IS_PTR(ptr);
}

/* UCS_PTR_STATUS */
ucs_status_t kvx_ucs_ptr_status(const void *ptr)
{
    return UCS_PTR_STATUS(ptr);
}

/* UCS_PTR_RAW_STATUS */
ucs_status_t kvx_ucs_ptr_raw_status(const void *ptr)
{
    return UCS_PTR_RAW_STATUS(ptr);
}

/* UCP_API_MAJOR, UCP_API_MINOR */
void kvx_ucp_api_version(unsigned *major, unsigned *minor)
{
    *major = UCP_API_MAJOR;
    *minor = UCP_API_MINOR;
}
