// Starts Swagger UI on the dashboard's OpenAPI schema (a file, not an inline script: the
// Content-Security-Policy allows scripts from this server only).
window.ui = SwaggerUIBundle({
  url: "/openapi.json",
  dom_id: "#swagger-ui",
  deepLinking: true,
  presets: [SwaggerUIBundle.presets.apis],
  layout: "BaseLayout",
});
