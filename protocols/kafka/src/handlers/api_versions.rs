use kafka_protocol::messages::ApiVersionsResponse;

use crate::versions;

pub(crate) fn handle() -> ApiVersionsResponse {
    let mut r = ApiVersionsResponse::default();
    r.api_keys = versions::advertised();
    r
}
